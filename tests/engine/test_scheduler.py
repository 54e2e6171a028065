"""Scheduler, driven in pure Python with fake sampled tokens (no model, no torch)."""
from __future__ import annotations

import pytest

from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulingPolicy
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ModelRunnerOutput

from .conftest import (check_kv_invariants, composition, drive_step, expected_outputs,
                       fake_runner_output, fake_token, make_request, make_scheduler)


def run_to_completion(sched: Scheduler, token_fn=fake_token, max_steps: int = 1000):
    """Drive until nothing is unfinished; returns the list of step outputs."""
    outs = []
    while sched.has_unfinished():
        out, _ = drive_step(sched, token_fn)
        check_kv_invariants(sched)
        outs.append(out)
        assert len(outs) < max_steps, "scheduler did not finish"
    return outs


# ----------------------------------------------------------------------------- config
def test_config_validation_and_token_budget():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="fifo")
    assert SchedulerConfig(max_num_batched_tokens=32, max_model_len=100,
                           policy="chunked").token_budget == 32
    assert SchedulerConfig(max_num_batched_tokens=32, max_model_len=100,
                           policy="naive").token_budget == 100
    assert SchedulerConfig(max_num_batched_tokens=300, max_model_len=100,
                           policy="static").token_budget == 300
    assert SchedulerConfig(policy="naive").policy is SchedulingPolicy.NAIVE


def test_long_prefill_token_threshold_caps_each_prefill_per_step():
    """Budget 16, cap 5: a 12-token prompt goes 5, 5, 2 beside a running decode, and two prompts
    admitted in one step each get 5 (vLLM's long_prefill_token_threshold); 0 is no cap."""
    kv_sched = make_scheduler(budget=16, block_size=4)
    kv_sched.config.long_prefill_token_threshold = 5
    kv_sched.add_request(make_request("d", 3, max_tokens=20))
    drive_step(kv_sched)                                     # d's prompt (3 < 5) and first token
    kv_sched.add_request(make_request("p", 12, max_tokens=2))
    kv_sched.add_request(make_request("q", 7, max_tokens=2))
    seen = [composition(drive_step(kv_sched)[0]) for _ in range(3)]
    assert seen == [[("d", 3, 1), ("p", 0, 5), ("q", 0, 5)],
                    [("d", 4, 1), ("p", 5, 5), ("q", 5, 2)],
                    [("d", 5, 1), ("q", 7, 1), ("p", 10, 2)]]
    check_kv_invariants(kv_sched)
    off = make_scheduler(budget=16, block_size=4)
    off.add_request(make_request("p", 12, max_tokens=2))
    assert composition(drive_step(off)[0]) == [("p", 0, 12)]
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        from sloserve.config import EngineConfig
        EngineConfig(long_prefill_token_threshold=-1).validate()


def test_prefill_pacing_cuts_a_long_prompt_beside_decodes_only():
    """max_model_len 256: prompts over 16 tokens are long. With decodes in the step a 40-token
    prompt advances by the paced 6 tokens, a 12-token one whole; alone, a long prompt takes the
    budget; pacing off or not measured yet (0): no cut."""
    def sched_with(pace: int, enable: bool = True, policy: str = "chunked") -> Scheduler:
        s = make_scheduler(budget=64, block_size=4, policy=policy)
        s.config.enable_prefill_pacing = enable
        s.paced_prefill_tokens = pace
        return s

    def long_beside_a_decode(s: Scheduler) -> list:
        """The step in which a 40-token prompt arrives while a request decodes."""
        s.add_request(make_request("d", 3, max_tokens=20))
        drive_step(s)
        s.add_request(make_request("L", 40, max_tokens=2))
        return composition(drive_step(s)[0])

    s = sched_with(6)
    assert s.config.long_prompt_tokens == 16
    s.add_request(make_request("d", 3, max_tokens=20))
    drive_step(s)
    s.add_request(make_request("L", 40, max_tokens=2))
    s.add_request(make_request("s", 12, max_tokens=20))
    seen = [composition(drive_step(s)[0]) for _ in range(3)]
    assert seen == [[("d", 3, 1), ("L", 0, 6), ("s", 0, 12)],
                    [("d", 4, 1), ("s", 12, 1), ("L", 6, 6)],
                    [("d", 5, 1), ("s", 13, 1), ("L", 12, 6)]]
    check_kv_invariants(s)
    alone = sched_with(6)
    alone.add_request(make_request("L", 40, max_tokens=2))
    assert composition(drive_step(alone)[0]) == [("L", 0, 40)]
    for off in (sched_with(6, enable=False), sched_with(0), sched_with(6, policy="naive")):
        assert long_beside_a_decode(off) == [("d", 3, 1), ("L", 0, 40)]


def test_long_prompts_share_one_paced_chunk_per_step_in_queue_order():
    """Three long prompts and a short one wait behind a decode (paced 6): the first long takes
    the step's 6 paced tokens, the other two keep their place at the front while the short one
    behind them starts; each step's long chunks add up to 6, the next long prompt taking what the
    one before it leaves."""
    s = make_scheduler(budget=64, block_size=4, num_blocks=128)
    s.paced_prefill_tokens = 6
    s.add_request(make_request("d", 3, max_tokens=60))
    drive_step(s)
    for rid in ("L0", "L1", "L2"):
        s.add_request(make_request(rid, 20, max_tokens=1))
    s.add_request(make_request("s", 10, max_tokens=60))
    first = composition(drive_step(s)[0])
    assert first == [("d", 3, 1), ("L0", 0, 6), ("s", 0, 10)]
    assert [r.request_id for r in s.waiting] == ["L1", "L2"]
    steps = [composition(drive_step(s)[0]) for _ in range(8)]
    long_chunks = [[c for c in step if c[0].startswith("L")] for step in steps]
    assert long_chunks == [[("L0", 6, 6)], [("L0", 12, 6)], [("L0", 18, 2), ("L1", 0, 4)],
                           [("L1", 4, 6)], [("L1", 10, 6)], [("L1", 16, 4), ("L2", 0, 2)],
                           [("L2", 2, 6)], [("L2", 8, 6)]]
    assert all(sum(n for _, _, n in chunks) == 6 for chunks in long_chunks)
    check_kv_invariants(s)


def _one_decoding(pace: int, decode_tokens: int = 20, **kw) -> Scheduler:
    """A scheduler (budget 64, blocks of 4) with ``pace`` paced tokens and one request "d" (3
    prompt tokens) past its prefill, decoding."""
    s = make_scheduler(budget=64, block_size=4, **kw)
    s.paced_prefill_tokens = pace
    s.add_request(make_request("d", 3, max_tokens=decode_tokens))
    drive_step(s)
    return s


def test_a_prompt_costing_over_two_decode_steps_is_paced():
    """Paced 6 tokens a step (about one decode step's time): a prompt of more than 2 x 6 tokens
    would add more than two decode steps to its step, so a 14-token prompt (under the 16 of
    long_prompt_tokens) is paced beside a decode; a 12-token one still goes whole."""
    s = _one_decoding(6)
    assert s.config.long_prompt_tokens == 16
    s.add_request(make_request("m", 14, max_tokens=2))
    s.add_request(make_request("s", 12, max_tokens=2))
    seen = [composition(drive_step(s)[0]) for _ in range(3)]
    assert seen == [[("d", 3, 1), ("m", 0, 6), ("s", 0, 12)],
                    [("d", 4, 1), ("s", 12, 1), ("m", 6, 6)],
                    [("d", 5, 1), ("m", 12, 2)]]
    check_kv_invariants(s)


def test_a_shorter_paced_prompt_takes_the_pace_before_a_long_one():
    """A 40-token prompt is paced beside a decode (6 a step); a 14-token prompt arriving then
    (also paced) takes the pace first, shortest rest first, so it does not wait out the long
    prefill; the long one gets what the short one leaves, then the whole pace again."""
    s = _one_decoding(6, 60, num_blocks=128)
    s.add_request(make_request("L", 40, max_tokens=1))
    assert composition(drive_step(s)[0]) == [("d", 3, 1), ("L", 0, 6)]
    s.add_request(make_request("m", 14, max_tokens=1))
    steps = [composition(drive_step(s)[0]) for _ in range(4)]
    prefills = [[c for c in step if c[0] in ("L", "m")] for step in steps]
    assert prefills == [[("m", 0, 6)], [("m", 6, 6)], [("L", 6, 4), ("m", 12, 2)],
                        [("L", 10, 6)]]
    assert all(step[0][0] == "d" for step in steps)  # the decode runs in every step
    check_kv_invariants(s)


def test_a_paced_prompt_behind_a_waiting_long_one_is_not_starved():
    """A 40-token prompt prefills paced beside a decode; a 60-token prompt then waits at the
    queue's front with a 14-token one behind it: the 14-token one (the shortest rest, waiting
    or running) takes the pace and starts; the 60-token one keeps its place at the front."""
    s = _one_decoding(6, 60, num_blocks=128)
    s.add_request(make_request("L", 40, max_tokens=1))
    assert composition(drive_step(s)[0]) == [("d", 3, 1), ("L", 0, 6)]
    s.add_request(make_request("W", 60, max_tokens=1))
    s.add_request(make_request("m", 14, max_tokens=1))
    steps = [composition(drive_step(s)[0]) for _ in range(3)]
    assert [[c for c in step if c[0] != "d"] for step in steps] == \
        [[("m", 0, 6)], [("m", 6, 6)], [("L", 6, 4), ("m", 12, 2)]]
    assert [r.request_id for r in s.waiting] == ["W"]
    check_kv_invariants(s)


def test_short_prompts_pass_a_long_prefill():
    """Nothing decodes and a 200-token prompt prefills with the whole budget (64); a 12-token
    prompt arriving then starts in the next step, whole, and the long prompt advances by the paced
    6 tokens beside it; then beside its decode. A long prompt waiting at the queue's front is
    passed; pacing off or unmeasured: the long prompt keeps the budget and the
    short one waits for it."""
    def with_long_running(pace: int, enable: bool = True) -> Scheduler:
        s = make_scheduler(budget=64, block_size=4, num_blocks=128)
        s.config.enable_prefill_pacing = enable
        s.paced_prefill_tokens = pace
        s.add_request(make_request("L", 200, max_tokens=2))
        assert composition(drive_step(s)[0]) == [("L", 0, 64)]
        return s

    s = with_long_running(6)
    s.add_request(make_request("s", 12, max_tokens=20))
    seen = [composition(drive_step(s)[0]) for _ in range(2)]
    assert seen == [[("L", 64, 6), ("s", 0, 12)], [("s", 12, 1), ("L", 70, 6)]]
    check_kv_invariants(s)

    # a 14-token prompt would be paced beside a decode (over 2 x 6) but goes whole when
    # nothing decodes; one arriving beside a decode gets the paced tokens (shorter rest)
    s = with_long_running(6)
    s.add_request(make_request("m", 14, max_tokens=20))
    assert composition(drive_step(s)[0]) == [("L", 64, 6), ("m", 0, 14)]
    s.add_request(make_request("m2", 14, max_tokens=20))
    assert composition(drive_step(s)[0]) == [("m", 14, 1), ("m2", 0, 6)]
    check_kv_invariants(s)

    # the short one behind a waiting long prompt passes it (it waited out the running long
    # prompt's prefill before: 10 s at the 1B shape); the waiting 40-token prompt, shorter than
    # the running one's 136 left, then takes the paced tokens
    s = with_long_running(6)
    s.add_request(make_request("L2", 40, max_tokens=2))
    s.add_request(make_request("s", 12, max_tokens=20))
    assert composition(drive_step(s)[0]) == [("s", 0, 12), ("L2", 0, 6)]
    assert not s.waiting
    check_kv_invariants(s)

    for off in (with_long_running(6, enable=False), with_long_running(0)):
        off.add_request(make_request("s", 12, max_tokens=20))
        assert composition(drive_step(off)[0]) == [("L", 64, 64)]
        assert [r.request_id for r in off.waiting] == ["s"]
        check_kv_invariants(off)


def test_prefill_pacing_is_off_with_slo_admission():
    """--ttft-slo-ms estimates TTFT from whole-budget chunks: pacing would overrun it."""
    from sloserve.config import EngineConfig
    assert SchedulerConfig().enable_prefill_pacing
    assert not SchedulerConfig(ttft_slo_s=1.0).enable_prefill_pacing
    assert not SchedulerConfig.of(EngineConfig(ttft_slo_ms=500.0), 1024).enable_prefill_pacing
    assert SchedulerConfig.of(EngineConfig(), 1024).enable_prefill_pacing


def test_step_rates_paced_prefill_tokens():
    """decode_step_s 4 ms; steps with prefill cost (step - 4 ms) / tokens each, the median of
    those prices a token; the paced chunk is one decode step's worth in whole 16s, at least 16."""
    from sloserve.engine.admission import StepRates
    r = StepRates()
    assert (r.prefill_token_s, r.paced_prefill_tokens) == (0.0, 0)
    r.update(16, 1, 0.008)                # prefill before any decode-only step: not yet priced
    assert (r.prefill_token_s, r.paced_prefill_tokens) == (0.0, 0)
    for _ in range(3):
        r.update(0, 2, 0.004)
    assert r.decode_step_s == pytest.approx(0.004)
    assert r.prefill_token_s == pytest.approx(0.00025)     # (8 - 4) ms / 16
    assert r.paced_prefill_tokens == 16
    r.update(40, 2, 0.0048)                                # 0.8 ms / 40 = 0.02 ms a token
    r.update(100, 0, 0.006)                                # 2 ms / 100
    assert r.prefill_token_s == pytest.approx(0.00002)
    assert r.paced_prefill_tokens == 192                   # 4 ms / 0.02 ms = 200: 12 x 16
    for _ in range(4):
        r.update(512, 0, 0.160)                            # 0.3 ms a token: under 16 -> 16
    assert r.prefill_token_s == pytest.approx((0.160 - 0.004) / 512)
    assert r.paced_prefill_tokens == 16
    free = StepRates()
    free.update(0, 1, 0.004)
    free.update(8, 1, 0.003)                               # cheaper than a decode step
    assert free.prefill_token_s == 0.0 and free.paced_prefill_tokens > 10 ** 6


def test_scheduled_request_is_plain_data():
    """Budget 4, block size 4: a 10-token prompt runs as chunks 0-3, 4-7, 8-9 (+ its first decode
    in the last step), then decodes; each record carries its token ids and whole block table."""
    sched = make_scheduler(budget=4, block_size=4)
    r = make_request("a", 10, max_tokens=3)
    sched.add_request(r)
    seen = []
    while sched.has_unfinished():
        out, _ = drive_step(sched)
        sr = out.scheduled[0]
        seen.append((sr.num_computed_tokens, sr.num_new_tokens, sr.end_pos, sr.samples,
                     sr.is_decode, len(sr.block_ids)))
        assert sr.token_ids == (r.prompt_token_ids + r.output_token_ids)[sr.start_pos:sr.end_pos]
        assert sr.sampling_params is r.sampling_params and sr.spec_token_ids == []
    assert seen == [(0, 4, 4, False, False, 1), (4, 4, 8, False, False, 2),
                    (8, 2, 10, True, False, 3), (10, 1, 11, True, True, 3),
                    (11, 1, 12, True, True, 3)]


# ----------------------------------------------------------------------------- add / validation
def test_add_request_rejects_empty_prompt():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="at least 1 token"):
        sched.add_request(Request("e", [], SamplingParams()))
    assert not sched.has_unfinished()


def test_add_request_rejects_prompt_over_max_model_len():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("ok", 32))
    with pytest.raises(ValueError, match="33 tokens.*max_model_len=32"):
        sched.add_request(make_request("long", 33))
    assert list(sched.requests) == ["ok"]


def test_add_request_rejects_prompt_over_kv_capacity():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="over the cache capacity of 16 tokens"):
        sched.add_request(make_request("big", 17))


def test_add_request_rejects_duplicate_id():
    sched = make_scheduler()
    sched.add_request(make_request("dup", 5))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("dup", 7))
    assert len(sched.waiting) == 1 and sched.waiting.peek_request().num_prompt_tokens == 5
    # a running request's id is also taken
    drive_step(sched)
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(make_request("dup", 3))


def test_empty_scheduler_schedules_nothing():
    sched = make_scheduler()
    out = sched.schedule(0.0)
    assert out.is_empty and out.num_batched_tokens == 0
    assert sched.update_from_output(out, ModelRunnerOutput()) == []


# ----------------------------------------------------------------------------- chunked
def test_chunked_splits_long_prompt_and_resumes_at_right_position():
    sched = make_scheduler(budget=16, block_size=4)
    a = make_request("a", 40, max_tokens=3)
    sched.add_request(a)
    steps = [composition(o) for o in run_to_completion(sched)]
    assert steps == [
        [("a", 0, 16)],
        [("a", 16, 16)],
        [("a", 32, 8)],      # last chunk samples the first output token
        [("a", 40, 1)],
        [("a", 41, 1)],
    ]
    assert a.output_token_ids == expected_outputs("a", 3)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert a.status.finish_reason == "length"
    assert sched.kv.num_free_blocks == 64


def test_chunked_prefill_chunk_samples_only_at_end_of_prompt():
    sched = make_scheduler(budget=16)
    a = make_request("a", 40, max_tokens=3)
    sched.add_request(a)
    out, _ = drive_step(sched)
    assert [s.samples for s in out.scheduled] == [False]
    assert a.num_computed_tokens == 16 and a.output_token_ids == []
    assert out.num_prefill_tokens == 16 and out.num_decode_tokens == 0
    drive_step(sched)
    out, _ = drive_step(sched)
    assert [s.samples for s in out.scheduled] == [True]
    assert a.num_computed_tokens == 40 and len(a.output_token_ids) == 1


def test_chunked_decodes_first_then_partial_prefill_then_new_prompts():
    sched = make_scheduler(budget=16, block_size=4)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    assert composition(drive_step(sched)[0]) == [("a", 0, 4)]
    b = make_request("b", 30, max_tokens=2)
    c = make_request("c", 20, max_tokens=2)
    sched.add_request(b)
    sched.add_request(c)
    # a decodes (1 token) first; the rest of the budget goes to b, FCFS; c gets nothing yet
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 4, 1), ("b", 0, 15)]
    assert [s.is_decode for s in out.scheduled] == [True, False]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 15
    # b is running part-way: it is continued before c is admitted; b samples its first token
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 5, 1), ("b", 15, 15)]
    assert len(b.output_token_ids) == 1
    # now two decodes (admission order), then c's first chunk with the remaining 14 tokens
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 6, 1), ("b", 30, 1), ("c", 0, 14)]
    assert b.is_finished and b.output_token_ids == expected_outputs("b", 2)
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 7, 1), ("c", 14, 6)]
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 8, 1), ("c", 20, 1)]


def test_chunked_decodes_listed_before_prefill_even_if_admitted_later():
    sched = make_scheduler(budget=8, block_size=4)
    a = make_request("a", 20, max_tokens=5)
    b = make_request("b", 2, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    assert composition(drive_step(sched)[0]) == [("a", 0, 8)]
    assert composition(drive_step(sched)[0]) == [("a", 8, 8)]
    # a finishes its prompt (4 tokens); b is admitted and prefilled whole (2 tokens)
    assert composition(drive_step(sched)[0]) == [("a", 16, 4), ("b", 0, 2)]
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 20, 1), ("b", 2, 1)]
    assert all(s.is_decode for s in out.scheduled)

    # c's long prompt arrives; it is admitted after the running decodes, listed last
    c = make_request("c", 30, max_tokens=1)
    sched.add_request(c)
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 21, 1), ("b", 3, 1), ("c", 0, 6)]
    assert [s.is_decode for s in out.scheduled] == [True, True, False]


@pytest.mark.parametrize("budget", [1, 3, 7, 16])
def test_chunked_budget_respected_every_step(budget):
    sched = make_scheduler(budget=budget, block_size=4, num_blocks=200)
    lens = [13, 1, 40, 7, 25]
    reqs = [make_request(f"r{i}", n, max_tokens=3) for i, n in enumerate(lens)]
    for r in reqs:
        sched.add_request(r)
    outs = run_to_completion(sched)
    for out in outs:
        assert 1 <= out.num_batched_tokens <= budget
    # every prompt token and every non-final output token went through the model exactly once
    assert sum(o.num_batched_tokens for o in outs) == sum(n + 3 - 1 for n in lens)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == expected_outputs(f"r{i}", 3)


def test_chunked_start_pos_is_contiguous_per_request():
    sched = make_scheduler(budget=5, block_size=2, num_blocks=100)
    for i, n in enumerate([12, 9, 3]):
        sched.add_request(make_request(f"r{i}", n, max_tokens=4))
    next_pos: dict[str, int] = {}
    for out in run_to_completion(sched):
        for s in out.scheduled:
            assert s.start_pos == next_pos.get(s.request_id, 0)
            next_pos[s.request_id] = s.end_pos
    assert next_pos == {"r0": 12 + 3, "r1": 9 + 3, "r2": 3 + 3}


# ----------------------------------------------------------------------------- naive
def test_naive_prefills_whole_prompt_with_running_decodes():
    sched = make_scheduler(policy="naive", budget=8, max_model_len=64, block_size=4)
    a = make_request("a", 4, max_tokens=6)
    sched.add_request(a)
    assert composition(drive_step(sched)[0]) == [("a", 0, 4)]
    b = make_request("b", 50, max_tokens=3)
    sched.add_request(b)
    out, _ = drive_step(sched)
    # the whole 50-token prompt in one step although max_num_batched_tokens is 8
    assert composition(out) == [("a", 4, 1), ("b", 0, 50)]
    assert out.num_batched_tokens == 51
    assert out.num_batched_tokens <= sched.config.token_budget == 64
    assert len(b.output_token_ids) == 1
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 5, 1), ("b", 50, 1)]


def test_naive_head_of_line_waits_for_whole_prompt():
    sched = make_scheduler(policy="naive", budget=8, max_model_len=64, block_size=4)
    a = make_request("a", 4, max_tokens=6)
    sched.add_request(a)
    drive_step(sched)
    b = make_request("b", 50, max_tokens=3)
    c = make_request("c", 20, max_tokens=1)
    d = make_request("d", 2, max_tokens=1)
    for r in (b, c, d):
        sched.add_request(r)
    # budget 64: a's decode (1) + b (50) leaves 13 < 20: c waits and d (behind c) waits too
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 4, 1), ("b", 0, 50)]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    # two decodes leave 62: c and then d are prefilled whole
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 5, 1), ("b", 50, 1), ("c", 0, 20), ("d", 0, 2)]
    assert c.is_finished and d.is_finished


def test_naive_never_chunks():
    sched = make_scheduler(policy="naive", budget=4, max_model_len=64, num_blocks=200)
    lens = [30, 5, 60, 1, 17]
    for i, n in enumerate(lens):
        sched.add_request(make_request(f"r{i}", n, max_tokens=3))
    for out in run_to_completion(sched):
        assert out.num_batched_tokens <= 64
        for s in out.scheduled:
            if not s.is_decode:
                assert s.start_pos == 0 and s.samples, "naive must prefill a prompt whole"


# ----------------------------------------------------------------------------- static
def test_static_admits_nothing_while_batch_runs():
    sched = make_scheduler(policy="static", budget=512, max_model_len=64, block_size=4)
    a = make_request("a", 6, max_tokens=2)
    b = make_request("b", 3, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    assert composition(drive_step(sched)[0]) == [("a", 0, 6), ("b", 0, 3)]
    c = make_request("c", 2, max_tokens=2)
    sched.add_request(c)
    assert composition(drive_step(sched)[0]) == [("a", 6, 1), ("b", 3, 1)]
    assert a.is_finished and a.num_output_tokens == 2
    # a left, b still runs: c still waits
    assert composition(drive_step(sched)[0]) == [("b", 4, 1)]
    assert composition(drive_step(sched)[0]) == [("b", 5, 1)]
    assert composition(drive_step(sched)[0]) == [("b", 6, 1)]
    assert b.is_finished and b.num_output_tokens == 5
    assert c.status is RequestStatus.WAITING and c.first_scheduled_time is None
    # nothing runs any more: the next batch (c) is admitted
    assert composition(drive_step(sched)[0]) == [("c", 0, 2)]
    assert composition(drive_step(sched)[0]) == [("c", 2, 1)]
    assert not sched.has_unfinished()


def test_static_batch_limited_by_budget_and_max_num_seqs():
    sched = make_scheduler(policy="static", budget=10, max_model_len=10, max_num_seqs=3,
                           num_blocks=100)
    for rid, n in [("a", 4), ("b", 4), ("c", 1), ("d", 1)]:
        sched.add_request(make_request(rid, n, max_tokens=2))
    # token budget 10: a and b (8 tokens) fit, c (1) too; d would, but max_num_seqs=3
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 1)]
    out, _ = drive_step(sched)
    assert composition(out) == [("a", 4, 1), ("b", 4, 1), ("c", 1, 1)]
    out, _ = drive_step(sched)
    assert composition(out) == [("d", 0, 1)]


# ----------------------------------------------------------------------------- max_num_seqs
@pytest.mark.parametrize("policy", ["chunked", "naive", "static"])
def test_max_num_seqs_respected(policy):
    sched = make_scheduler(policy=policy, budget=64, max_num_seqs=2, num_blocks=100,
                           max_model_len=64)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3 + i, max_tokens=2 + i % 3))
    admitted_order = []
    for out in run_to_completion(sched):
        assert len(out.scheduled) <= 2
        assert len(sched.running) <= 2
        for s in out.scheduled:
            if s.request_id not in admitted_order:
                admitted_order.append(s.request_id)
    assert admitted_order == [f"r{i}" for i in range(5)]  # FCFS


def test_max_num_seqs_admits_next_when_one_finishes():
    sched = make_scheduler(budget=64, max_num_seqs=2)
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=3))
    sched.add_request(make_request("c", 3, max_tokens=1))
    out, fin = drive_step(sched)
    assert composition(out) == [("a", 0, 3), ("b", 0, 3)]
    assert [r.request_id for r in fin] == ["a"]
    out, _ = drive_step(sched)
    assert composition(out) == [("b", 3, 1), ("c", 0, 3)]


# ----------------------------------------------------------------------------- preemption
def _preemption_setup():
    # 6 blocks of 4 tokens; a and b each take 2 blocks for their 8-token prompts
    sched = make_scheduler(budget=64, block_size=4, num_blocks=6, max_num_seqs=2)
    a = make_request("a", 8, max_tokens=10)
    b = make_request("b", 8, max_tokens=10)
    c = make_request("c", 3, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)
    return sched, a, b, c


def test_preemption_of_most_recent_request_when_kv_runs_out():
    sched, a, b, c = _preemption_setup()
    assert composition(drive_step(sched)[0]) == [("a", 0, 8), ("b", 0, 8)]
    # positions 8..11 need a third block each: 6 blocks used after the first decode
    for pos in range(8, 12):
        out, _ = drive_step(sched)
        assert composition(out) == [("a", pos, 1), ("b", pos, 1)]
        assert out.preempted_request_ids == []
        check_kv_invariants(sched)
    assert sched.kv.num_free_blocks == 0
    b_outputs_before = list(b.output_token_ids)
    assert len(b_outputs_before) == 5
    # position 12 needs a 4th block for a: b (admitted after a) is preempted
    out, _ = drive_step(sched)
    assert out.preempted_request_ids == ["b"]
    assert composition(out) == [("a", 12, 1)]
    assert sched.num_preemptions == 1
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == b_outputs_before        # generated tokens are kept
    assert sched.kv.get_block_table("b") == []
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # front of the queue
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.kv.num_free_blocks == 2
    check_kv_invariants(sched)

    # b now needs 13 tokens recomputed = 4 blocks; only 2 free until a finishes
    steps = [composition(drive_step(sched)[0]) for _ in range(3)]
    assert steps == [[("a", 13, 1)], [("a", 14, 1)], [("a", 15, 1)]]
    assert b.status is RequestStatus.PREEMPTED
    out, fin = drive_step(sched)  # a samples its 10th token and finishes
    assert composition(out) == [("a", 16, 1)]
    assert [r.request_id for r in fin] == ["a"]
    assert a.output_token_ids == expected_outputs("a", 10)

    # b is recomputed: prompt (8) + its 5 generated tokens in one chunk, then decodes;
    # c (behind it in the queue) is admitted in the same step
    out, _ = drive_step(sched)
    assert composition(out) == [("b", 0, 13), ("c", 0, 3)]
    sr = out.scheduled[0]
    assert sr.samples and not sr.is_decode
    assert b.token_ids_range(0, 13) == b.prompt_token_ids + b_outputs_before
    assert len(b.output_token_ids) == 6
    run_to_completion(sched)
    assert b.output_token_ids == expected_outputs("b", 10)
    assert b.status.finish_reason == "length"
    assert c.output_token_ids == expected_outputs("c", 2)
    assert sched.num_preemptions == 1
    assert sched.kv.num_free_blocks == 6


def test_preemption_victim_is_newest_of_three():
    sched = make_scheduler(budget=64, block_size=2, num_blocks=6)
    reqs = [make_request(r, 4, max_tokens=4) for r in ("x", "y", "z")]
    for r in reqs:
        sched.add_request(r)
    out, _ = drive_step(sched)   # 3 x 2 blocks: pool full
    assert composition(out) == [("x", 0, 4), ("y", 0, 4), ("z", 0, 4)]
    assert sched.kv.num_free_blocks == 0
    out, _ = drive_step(sched)
    # x needs a block: z (newest) is preempted; y also needs one and z's 2 freed blocks serve both
    assert out.preempted_request_ids == ["z"]
    assert composition(out) == [("x", 4, 1), ("y", 4, 1)]
    assert [r.request_id for r in sched.waiting] == ["z"]
    run_to_completion(sched)
    for r in reqs:
        assert r.output_token_ids == expected_outputs(r.request_id, 4)
        assert r.status is RequestStatus.FINISHED_LENGTH


def test_preemption_in_naive_and_static_recomputes_whole():
    for policy in ("naive", "static"):
        sched = make_scheduler(policy=policy, budget=8, block_size=4, num_blocks=5,
                               max_model_len=32)
        a = make_request("a", 6, max_tokens=10)
        b = make_request("b", 6, max_tokens=10)
        sched.add_request(a)
        sched.add_request(b)
        outs = run_to_completion(sched)
        assert sched.num_preemptions >= 1, policy
        assert b.num_preemptions >= 1 and a.num_preemptions == 0
        recomputes = [s for o in outs for s in o.scheduled
                      if s.request_id == "b" and s.start_pos == 0]
        assert len(recomputes) == 1 + b.num_preemptions
        for s in recomputes[1:]:
            assert s.num_new_tokens > 6 and s.samples  # prompt + generated tokens, in one piece
        assert a.output_token_ids == expected_outputs("a", 10)
        assert b.output_token_ids == expected_outputs("b", 10)
        assert sched.kv.num_free_blocks == 5


def test_request_that_can_never_fit_the_kv_cache_does_not_hang():
    """prompt + max_tokens over the whole KV cache: the request can never complete. The scheduler
    must not keep it unfinished forever (today it is preempted once it fills the cache, then can
    never be re-admitted, so every later step is empty while has_unfinished() stays True and
    LLM.generate spins forever). It must either reject it in add_request or finish it (e.g.
    "length") within a bounded number of steps."""
    sched = make_scheduler(budget=64, block_size=4, num_blocks=4, max_model_len=64)
    r = make_request("r", 8, max_tokens=20)        # needs 27 slots, the cache holds 16
    try:
        sched.add_request(r)
    except ValueError:
        return
    for _ in range(100):
        if not sched.has_unfinished():
            break
        drive_step(sched)
    assert not sched.has_unfinished(), (
        f"hang: after 100 steps the request is {r.status.value} with "
        f"{r.num_output_tokens} outputs and {r.num_preemptions} preemptions")


# ----------------------------------------------------------------------------- stopping
def test_eos_finishes_with_stop():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=10, eos=(2,))
    sched.add_request(r)
    toks = iter([50, 51, 2, 53])
    finished = []
    while sched.has_unfinished():
        _, fin = drive_step(sched, lambda req: next(toks))
        finished += fin
    assert finished == [r]
    assert r.output_token_ids == [50, 51, 2]     # the EOS token is the last output
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert r.status.finish_reason == "stop"
    assert sched.kv.num_free_blocks == 64


def test_any_of_several_eos_ids_stops():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=10, eos=(2, 3))
    sched.add_request(r)
    toks = iter([50, 3, 2])
    run_to_completion(sched, lambda req: next(toks))
    assert r.output_token_ids == [50, 3]
    assert r.status.finish_reason == "stop"


def test_ignore_eos_keeps_going_to_max_tokens():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=4, eos=(2,), ignore_eos=True)
    sched.add_request(r)
    run_to_completion(sched, lambda req: 2)
    assert r.output_token_ids == [2, 2, 2, 2]
    assert r.status.finish_reason == "length"


def test_stop_token_ids_finish_with_stop_even_with_ignore_eos():
    sched = make_scheduler()
    r = make_request("r", 5, max_tokens=10, eos=(2,), ignore_eos=True, stop_token_ids=[77])
    sched.add_request(r)
    toks = iter([2, 60, 77, 61])
    run_to_completion(sched, lambda req: next(toks))
    assert r.output_token_ids == [2, 60, 77]
    assert r.status.finish_reason == "stop"


def test_max_tokens_gives_length_with_exact_count():
    for mt in (1, 2, 7):
        sched = make_scheduler()
        r = make_request("r", 9, max_tokens=mt)
        sched.add_request(r)
        outs = run_to_completion(sched)
        assert r.output_token_ids == expected_outputs("r", mt)
        assert r.status.finish_reason == "length"
        assert len(outs) == mt                  # one prefill step + mt - 1 decodes
        assert r.finished_time is not None


def test_max_model_len_gives_length():
    sched = make_scheduler(max_model_len=12)
    r = make_request("r", 10, max_tokens=None)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.num_tokens == 12 and r.num_output_tokens == 2
    assert r.status.finish_reason == "length"


def test_eos_on_first_token_after_chunked_prefill():
    sched = make_scheduler(budget=4)
    r = make_request("r", 10, max_tokens=5, eos=(2,))
    sched.add_request(r)
    outs = run_to_completion(sched, lambda req: 2)
    assert [composition(o) for o in outs] == [[("r", 0, 4)], [("r", 4, 4)], [("r", 8, 2)]]
    assert r.output_token_ids == [2] and r.status.finish_reason == "stop"


def test_timestamps():
    sched = make_scheduler(budget=4)
    r = make_request("r", 6, max_tokens=2)
    sched.add_request(r)
    for t in (1.0, 2.0, 3.0):
        drive_step(sched, now=t)
    assert r.first_scheduled_time == 1.0
    assert r.first_token_time == 2.0
    assert r.last_token_time == 3.0
    assert r.finished_time == 3.0


# ----------------------------------------------------------------------------- abort
def test_abort_running_request_frees_blocks_at_once():
    sched = make_scheduler(budget=8, num_blocks=16, block_size=4)
    a = make_request("a", 20, max_tokens=5)
    b = make_request("b", 6, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    drive_step(sched)                     # a: 8 of 20 tokens (2 blocks)
    drive_step(sched)                     # a: 16 of 20 (4 blocks)
    assert len(sched.kv.get_block_table("a")) == 4
    free_before = sched.kv.num_free_blocks
    got = sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert got is a
    assert a.status.finish_reason == "abort"
    assert sched.kv.num_free_blocks == free_before + 4
    assert a not in sched.running and "a" not in sched.requests
    check_kv_invariants(sched)
    outs = run_to_completion(sched)
    assert all(s.request_id == "b" for o in outs for s in o.scheduled)
    assert b.output_token_ids == expected_outputs("b", 5)
    assert sched.kv.num_free_blocks == 16


def test_abort_queued_request():
    sched = make_scheduler(budget=4, max_num_seqs=1)
    a = make_request("a", 4, max_tokens=2)
    b = make_request("b", 4, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    drive_step(sched)
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert list(sched.waiting) == []
    assert b.status is RequestStatus.FINISHED_ABORTED
    outs = run_to_completion(sched)
    assert all(s.request_id == "a" for o in outs for s in o.scheduled)
    assert sched.kv.num_free_blocks == 64
    # unknown / already finished ids are ignored
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert sched.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None


def test_abort_preempted_request_in_queue():
    sched, a, b, c = _preemption_setup()
    for _ in range(6):
        out, _ = drive_step(sched)
    assert b.status is RequestStatus.PREEMPTED
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert [r.request_id for r in sched.waiting] == ["c"]
    check_kv_invariants(sched)
    run_to_completion(sched)
    assert a.output_token_ids == expected_outputs("a", 10)
    assert b.num_output_tokens == 5
    assert sched.kv.num_free_blocks == 6


def test_abort_between_schedule_and_update():
    """The engine may abort a request after schedule() but before update_from_output(): its blocks
    are freed once and the update ignores it."""
    sched = make_scheduler(budget=16, num_blocks=8, block_size=4)
    a = make_request("a", 6, max_tokens=3)
    b = make_request("b", 6, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(0.0)
    assert composition(out) == [("a", 0, 6), ("b", 0, 6)]
    runner_out = fake_runner_output(sched, out)  # a's token is sampled before the abort lands
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    finished = sched.update_from_output(out, runner_out)
    assert [o.request_id for o in finished] == ["b"] and not finished[0].finished
    assert a.output_token_ids == [] and a.status is RequestStatus.FINISHED_ABORTED
    assert b.num_output_tokens == 1
    check_kv_invariants(sched)
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 8


def test_finish_request_with_stop_status():
    """finish_request is also how the engine ends a request on a stop string."""
    sched = make_scheduler()
    r = make_request("r", 4, max_tokens=10)
    sched.add_request(r)
    drive_step(sched)
    sched.finish_request("r", RequestStatus.FINISHED_STOPPED)
    assert r.status.finish_reason == "stop"
    assert not sched.has_unfinished() and sched.num_unfinished == 0
    assert sched.kv.num_free_blocks == 64


def test_a_request_whose_logits_could_not_be_sampled_fails_alone():
    """The runner's ``errors``: that request finishes aborted with the error and its blocks
    freed; the others in the step get their tokens and go on to finish normally."""
    from .conftest import fake_runner_output, make_request, make_scheduler
    sched = make_scheduler(budget=64)  # the three prompts in one step
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 6, max_tokens=3))
    reqs = dict(sched.requests)
    out = sched.schedule(0.0)
    ro = fake_runner_output(sched, out)
    i = ro.req_ids.index("b")
    ro.sampled_token_ids[i] = []
    ro.errors = {"b": "cannot sample the next token"}
    outs = {o.request_id: o for o in sched.update_from_output(out, ro, 1.0)}
    assert outs["b"].finish_reason == "abort" and outs["b"].error == "cannot sample the next token"
    assert outs["b"].new_token_ids == [] and "b" not in sched.requests
    assert [len(outs[r].new_token_ids) for r in ("a", "c")] == [1, 1]
    check_kv_invariants(sched)
    run_to_completion(sched)
    assert reqs["b"].status is RequestStatus.FINISHED_ABORTED
    for rid in ("a", "c"):
        assert reqs[rid].output_token_ids == expected_outputs(rid, 3)
    check_kv_invariants(sched)
