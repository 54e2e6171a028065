"""Priority scheduling, SLO-aware deferral, the admission rules (the per-client cap on grammar
compiles included), and the scheduling flags."""
from __future__ import annotations

import argparse

import pytest

from sloserve.config import EngineConfig, add_scheduler_args, batching_from_args
from sloserve.engine.admission import (AdmissionLimits, CompileSlots, Rejection, StepRates,
                                       check_admission, check_arrival, estimate_ttft_s)
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.request import Request
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.sampling_params import SamplingParams

from .conftest import (check_kv_invariants, drive_step, expected_outputs, fake_runner_output,
                       prompt_ids)


def _sched(queue_policy="priority", num_blocks=64, max_num_seqs=8, budget=64, **kw) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                     max_model_len=128, queue_policy=queue_policy, **kw),
                     KVCacheManager(num_blocks, 4))


def _req(rid, n=8, priority=0, arrival=0.0, max_tokens=4) -> Request:
    return Request(rid, prompt_ids(rid, n), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   arrival_time=arrival, priority=priority)


def test_priority_orders_the_waiting_queue_by_priority_then_arrival():
    s = _sched(max_num_seqs=1)
    for rid, p, t in [("a", 5, 0.0), ("b", 1, 1.0), ("c", 1, 0.5), ("d", 3, 0.1)]:
        s.add_request(_req(rid, priority=p, arrival=t))
    assert [r.request_id for r in s.waiting] == ["c", "b", "d", "a"]
    fcfs = _sched("fcfs")
    for rid, p in [("a", 5), ("b", 1)]:
        fcfs.add_request(_req(rid, priority=p))
    assert [r.request_id for r in fcfs.waiting] == ["a", "b"]


def test_a_higher_priority_arrival_preempts_the_lowest_priority_running_request():
    s = _sched(max_num_seqs=2)
    low, mid = _req("low", priority=9, max_tokens=20), _req("mid", priority=5, max_tokens=20)
    s.add_request(low)
    s.add_request(mid)
    drive_step(s)
    drive_step(s)
    urgent = _req("urgent", priority=0, arrival=2.0, max_tokens=3)
    s.add_request(urgent)
    out, _ = drive_step(s)
    assert out.preempted_request_ids == ["low"]
    assert {x.request_id for x in out.scheduled} == {"mid", "urgent"}
    check_kv_invariants(s)
    while s.has_unfinished():
        drive_step(s)
    for r in (low, mid, urgent):  # recompute preemption loses nothing
        assert r.output_token_ids == expected_outputs(r.request_id, r.sampling_params.max_tokens)


def test_an_equal_priority_arrival_waits_for_a_seat():
    s = _sched(max_num_seqs=1)
    s.add_request(_req("a", priority=1, max_tokens=6))
    drive_step(s)
    s.add_request(_req("b", priority=1, arrival=1.0))
    out, _ = drive_step(s)
    assert not out.preempted_request_ids and [x.request_id for x in out.scheduled] == ["a"]


def test_a_kv_shortage_preempts_lower_priority_first():
    s = _sched(num_blocks=8, max_num_seqs=4, budget=64)
    s.add_request(_req("low", n=16, priority=7, max_tokens=8))   # 4 + 2 blocks
    drive_step(s)
    s.add_request(_req("high", n=16, priority=1, arrival=1.0, max_tokens=4))
    out, _ = drive_step(s)
    assert out.preempted_request_ids == ["low"] and [x.request_id for x in out.scheduled] == ["high"]
    while s.has_unfinished():
        drive_step(s)
    assert s.kv.num_free_blocks == 8


def test_slo_deferral_moves_the_hopeless_behind_and_still_serves_them():
    s = _sched("fcfs", max_num_seqs=1, budget=16, ttft_slo_s=1.0, slo_deferral=True)
    s.prefill_step_s = 0.16  # 15 prompt tokens per step beside the running decode
    s.add_request(_req("run", n=4, max_tokens=30))
    drive_step(s, now=0.0)
    old = _req("old", n=40, arrival=0.0)     # waited 0.9 s and needs 3 steps more: hopeless
    new = _req("new", n=8, arrival=0.85)
    s.add_request(old)
    s.add_request(new)
    out = s.schedule(0.9)
    assert [r.request_id for r in s.waiting] == ["new", "old"] and old.deferred and not new.deferred
    assert s.num_deferred == 1
    s.update_from_output(out, fake_runner_output(s, out), 0.9)
    while s.has_unfinished():
        drive_step(s, now=1.0)
    assert old.output_token_ids == expected_outputs("old", 4)


def test_step_rates_are_robust_to_tail_chunks_and_slow_outliers():
    r = StepRates()
    assert r.prefill_tokens_per_s == 0 and r.decode_step_s == 0 and r.prefill_step_s == 0
    for _ in range(5):
        r.update(500, 0, 0.25)   # 2000 tok/s
    r.update(4, 0, 0.02)         # a tiny tail chunk (200 tok/s) weighs 4 tokens
    r.update(512, 0, 2.0)        # one cold step (256 tok/s)
    assert r.prefill_tokens_per_s == 2000.0
    assert r.prefill_step_s == 2.0   # the latest step (and the 90th percentile of 7)
    for _ in range(9):
        r.update(500, 0, 0.25)
    r.update(500, 0, 0.3)
    r.update(500, 0, 0.2)
    assert r.prefill_step_s == 0.3   # 90th percentile of 0.02, 0.2, 0.25 x14, 0.3, 2.0
    for t in (0.03, 0.03, 0.5):
        r.update(0, 16, t)
    assert r.decode_step_s == 0.03


def test_ttft_estimate_counts_whole_steps():
    # 1,200 tokens at 500 per step: 3 steps, the last one as long as the others
    assert estimate_ttft_s(1000, 200, 500, 0.35, wait_s=0.05) == pytest.approx(1.10)
    assert estimate_ttft_s(0, 200, 500, 0.35) == pytest.approx(0.35)   # one step, not 200/500 of one
    assert estimate_ttft_s(0, 500, 500, 0.35) == pytest.approx(0.35)
    assert estimate_ttft_s(0, 501, 500, 0.35) == pytest.approx(0.70)
    assert estimate_ttft_s(0, 3, 0, 0.1) == pytest.approx(0.3)        # decodes fill the budget: 1 token a step
    assert estimate_ttft_s(0, 3, 500, 0.0) is None                    # no step measured yet


def test_check_admission_queue_limit_and_slo():
    kw = dict(queue_tokens=1000, prompt_tokens=200, prefill_budget=500, prefill_step_s=0.35,
              prefill_tokens_per_s=1000.0, wait_s=0.05)
    assert check_admission(num_waiting=3, max_waiting_requests=4, ttft_slo_s=None,
                           reject_over_slo=True, **kw) is None
    rej = check_admission(num_waiting=4, max_waiting_requests=4, ttft_slo_s=None,
                          reject_over_slo=True, **kw)
    assert "4 requests are waiting, the limit is 4" in rej.message and rej.retry_after_s == 1
    rej = check_admission(num_waiting=0, max_waiting_requests=None, ttft_slo_s=1.0,
                          reject_over_slo=True, **kw)
    assert "estimated TTFT 1100 ms" in rej.message and "3 steps of 350 ms" in rej.message
    assert "limit 1000 ms" in rej.message
    assert check_admission(num_waiting=0, max_waiting_requests=None, ttft_slo_s=1.2,
                           reject_over_slo=True, **kw) is None
    assert check_admission(num_waiting=0, max_waiting_requests=None, ttft_slo_s=1.0,
                           reject_over_slo=False, **kw) is None     # defer: queued
    unknown = dict(kw, prefill_step_s=0.0)
    assert check_admission(num_waiting=0, max_waiting_requests=None, ttft_slo_s=0.001,
                           reject_over_slo=True, **unknown) is None  # no step time yet: admit


def test_admission_limits_of_the_engine_settings():
    assert AdmissionLimits.of(EngineConfig()) == AdmissionLimits(None, None, True)
    assert not AdmissionLimits.of(EngineConfig()).active
    assert AdmissionLimits.of(EngineConfig(max_waiting_requests=3)).active
    slo = EngineConfig(ttft_slo_ms=250, slo_admission="defer")
    assert AdmissionLimits.of(slo) == AdmissionLimits(None, 0.25, False)
    assert not AdmissionLimits.of(slo).active            # deferral is the scheduler's, not here
    assert AdmissionLimits.of(EngineConfig(ttft_slo_ms=250)).active


def test_check_arrival_reads_a_scheduler_or_its_published_stats_alike():
    """The core's published SchedulerStats (what the API process and the simulator's engine
    core both read) carry a scheduler's queue as check_arrival needs it; requests on their way
    to the core queue ahead (their tokens) and wait beyond the free seats."""
    from sloserve.engine.messages import SchedulerStats
    s = _sched("fcfs", max_num_seqs=2, budget=16)
    for rid, n in (("a", 20), ("b", 12), ("c", 8)):
        s.add_request(_req(rid, n=n))
    drive_step(s)  # a: 16 of its 20 prompt tokens; b and c wait
    rates = StepRates()
    rates.update(16, 0, 0.5)
    assert (len(s.waiting), s.num_tokens_to_prefill(), s.prefill_budget()) == (2, 4 + 12 + 8, 16)
    assert (rates.prefill_step_s, rates.prefill_tokens_per_s) == (0.5, 32.0)
    stats = SchedulerStats(num_running=1, num_waiting=2, num_waiting_tokens=24,
                           prefill_budget=16, prefill_step_s=0.5, prefill_tokens_per_s=32.0)
    slo = AdmissionLimits(None, 1.5, True)
    for view in (stats,):
        assert check_arrival(slo, view, 8, wait_s=0.1) is None          # 2 steps of 0.5 s + 0.1 s
        rej = check_arrival(slo, view, 9, wait_s=0.1)                   # 3 steps
        assert "estimated TTFT 1600 ms (24 prompt tokens queued ahead + 9" in rej.message
        rej = check_arrival(slo, view, 8, wait_s=0.1, in_transit_tokens=[10])
        assert "(34 prompt tokens queued ahead + 8" in rej.message
    # every request on its way waits once it lands (the core queues an arrival before it
    # schedules it), and a request of n choices needs n places, all or none
    limit = AdmissionLimits(max_waiting_requests=5)
    assert check_arrival(limit, stats, 8, 0.0, in_transit_tokens=[5, 5]) is None  # 2 + 2 + 1
    rej = check_arrival(limit, stats, 8, 0.0, in_transit_tokens=[5, 5, 5])
    assert "5 requests are waiting, the limit is 5" in rej.message
    assert check_arrival(limit, stats, [8, 8, 8], 0.0) is None                    # 2 + 3
    rej = check_arrival(limit, stats, [8, 8, 8], 0.0, in_transit_tokens=[5])     # 3 + 3 > 5
    assert "3 requests are waiting and this one needs 3 places, the limit is 5" in rej.message
    # n choices share a prompt: the TTFT estimate is the longest one's, not their sum
    assert check_arrival(slo, stats, [8, 8, 8], wait_s=0.1) is None
    assert check_arrival(slo, stats, [8, 9], wait_s=0.1) is not None
    assert check_arrival(AdmissionLimits(), stats, 10 ** 6, 1e9, [1] * 99) is None  # off


def test_compile_slots_cap_the_new_grammars_of_each_client():
    """``--max-pending-compiles-per-client 2``: a client may wait on two new grammars at once;
    a third is a 429 naming the flag, while other clients, requests sharing a grammar already
    pending and grammars known compiled are not held back; a grammar counts until one of its
    requests got an output (then it is known compiled) or ended."""
    slots = CompileSlots(2)
    a = slots.acquire("10.0.0.1", "json schema:A")
    b = slots.acquire("10.0.0.1", "json schema:B")
    b2 = slots.acquire("10.0.0.1", "json schema:B")  # shares B's compile
    assert slots.pending("10.0.0.1") == 2
    rej = slots.acquire("10.0.0.1", "regex:C")
    assert isinstance(rej, Rejection) and rej.retry_after_s == 1
    assert rej.message.startswith("client 10.0.0.1 has 2 structured-output grammars compiling, "
                                  "the limit is 2 per client (--max-pending-compiles-per-client)")
    other = slots.acquire("10.0.0.2", "regex:C")
    assert other is not None and slots.pending("10.0.0.2") == 1
    b.release()
    assert slots.pending("10.0.0.1") == 2  # b2 still waits on B
    a.compiled()  # A's first output: A is compiled, for every client
    assert slots.pending("10.0.0.1") == 1
    assert slots.acquire("10.0.0.3", "json schema:A") is None
    c = slots.acquire("10.0.0.1", "regex:C")
    assert not isinstance(c, Rejection)
    for s in (a, b2, b2, c, other):
        s.release()  # idempotent
    assert slots.pending("10.0.0.1") == slots.pending("10.0.0.2") == 0
    assert CompileSlots(0).acquire("x", "regex:D") is None  # 0: no cap


def _flags(*argv) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_scheduler_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,mode", [((), "chunked"), (("--no-enable-chunked-prefill",), "naive"),
                                       (("--static-batching",), "static"),
                                       (("--scheduling-policy", "naive"), "naive"),
                                       (("--scheduling-policy", "static"), "static"),
                                       (("--scheduling-policy", "priority"), "chunked")])
def test_batching_flags_new_and_deprecated_spellings(argv, mode, caplog):
    assert batching_from_args(_flags(*argv)) == mode
    deprecated = "naive" in argv or "static" in argv
    assert any("deprecated" in r.message for r in caplog.records) == deprecated


def test_engine_config_maps_the_old_policy_and_validates_the_new():
    c = EngineConfig(scheduling_policy="naive")
    assert c.scheduling_policy == "fcfs" and c.batching == "naive"
    assert SchedulerConfig.of(EngineConfig(scheduling_policy="priority"), 64).queue_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo").validate()
    with pytest.raises(ValueError, match="ttft_slo_ms must be a positive"):
        EngineConfig(ttft_slo_ms=0).validate()
    with pytest.raises(ValueError, match="max_waiting_requests must be an integer >= 1"):
        EngineConfig(max_waiting_requests=0).validate()
    with pytest.raises(ValueError, match="structured_outputs_compile_timeout must be a number "
                                         "of seconds >= 0"):
        EngineConfig(structured_outputs_compile_timeout=-1).validate()
    with pytest.raises(ValueError, match="max_pending_compiles_per_client must be an integer"):
        EngineConfig(max_pending_compiles_per_client=-1).validate()

