"""The simulator runs the engine's own scheduler: same decisions as the real engine, determinism,
failures as the server reports them, and the chunked-prefill effect in a memory-bound regime."""
from __future__ import annotations

import numpy as np
import pytest

import sloserve
from sloserve.bench.arrivals import arrival_times
from sloserve.bench.datasets import mixed_workload
from sloserve.bench.metrics import calculate_metrics
from sloserve.sampling_params import SamplingParams
from sloserve.sim.cost_model import (LinearCostModel, OverlapCostModel, RooflineCostModel,
                                     StepComposition)
from sloserve.sim.simulator import SimConfig, simulate, simulate_cluster
from sloserve.sim.workload import LengthOnlyFactory
from sloserve.workload import SampleRequest

from .helpers import record_compositions

PROMPTS = [5, 37, 12, 64, 3, 20]
OUTPUTS = [7, 3, 12, 5, 9, 4]


def _engine_steps(tiny_llama_dir, policy, num_kv_blocks, budget=16):
    llm = sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=num_kv_blocks,
                       block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                       scheduling_policy=policy)
    eng = llm.engine
    comps = record_compositions(eng)
    for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS)):
        eng.add_request([10 + (7 * i + j) % 50 for j in range(p)],
                        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    c = eng.scheduler.config
    cfg = SimConfig(max_num_batched_tokens=c.max_num_batched_tokens, max_num_seqs=c.max_num_seqs,
                    max_model_len=c.max_model_len, policy=policy, num_kv_blocks=num_kv_blocks,
                    block_size=4)
    return comps, cfg, eng.summary


@pytest.mark.parametrize("policy,num_kv_blocks", [("chunked", 64), ("naive", 64), ("static", 64),
                                                  ("chunked", 24)])
def test_simulator_makes_the_engines_scheduling_decisions(tiny_llama_dir, policy, num_kv_blocks):
    engine_comps, cfg, summary = _engine_steps(tiny_llama_dir, policy, num_kv_blocks)
    reqs = [SampleRequest("", p, o) for p, o in zip(PROMPTS, OUTPUTS)]
    res = simulate(reqs, [0.0] * len(reqs), cfg, OverlapCostModel(0.01, 1000.0), record_steps=True)
    assert [c for _, c in res.steps] == engine_comps
    assert [r.output_tokens for r in res.records] == OUTPUTS
    if num_kv_blocks == 24:  # the tight pool preempts, in the engine and in the simulator alike
        assert res.num_preemptions > 0


def test_same_seed_same_result_and_times_advance_by_the_cost_model():
    reqs = mixed_workload(LengthOnlyFactory(), 60, scale=0.25, seed=3)
    arr = arrival_times(60, 4.0, seed=3)
    cost = LinearCostModel([0.01, 0.001, 1e-6, 0.0005, 1e-8])
    a = simulate(reqs, arr, SimConfig(max_num_batched_tokens=256), cost, record_steps=True)
    b = simulate(reqs, arr, SimConfig(max_num_batched_tokens=256), cost, record_steps=True)
    assert [r.chunk_times for r in a.records] == [r.chunk_times for r in b.records]
    ends = [t for t, _ in a.steps]
    assert all(y > x for x, y in zip(ends, ends[1:]))
    # each step lasts exactly its cost once the engine is busy (no idle gap inside a busy period)
    for (t0, _), (t1, comp) in zip(a.steps, a.steps[1:]):
        assert t1 - t0 >= cost.step_time(comp) - 1e-12
    for r, t in zip(a.records, arr):
        assert r.success and r.send_time == t and r.ttft > 0
        assert len(r.itl) == r.output_tokens - 1


def test_a_request_over_the_context_fails_like_the_servers_400():
    reqs = [SampleRequest("", 10, 5), SampleRequest("", 100, 5)]
    res = simulate(reqs, [0.0, 0.0], SimConfig(max_model_len=64), OverlapCostModel(0.01, 1e4))
    ok, bad = res.records
    assert ok.success and ok.output_tokens == 5
    assert not bad.success and bad.error.startswith("HTTP 400: ") and "max_model_len" in bad.error
    m = calculate_metrics(res.records, res.duration)
    assert (m.completed, m.failed) == (1, 1)


def test_lecture_setup_chunking_cuts_p99_tpot_when_decode_is_memory_bound():
    """Poisson 6 req/s, mixed 80 % 128/256/512 + 20 % 2048/4096, outputs 30-80; decode step 22 ms,
    prefill 35,000 tokens/s, overlapping (an 8B model on an H100)."""
    reqs = mixed_workload(LengthOnlyFactory(), 400, seed=0)
    arr = arrival_times(400, 6.0, seed=0)
    cost = OverlapCostModel(0.022, 35000.0)
    p99 = {}
    for policy in ("naive", "chunked"):
        res = simulate(reqs, arr, SimConfig(max_num_batched_tokens=512, policy=policy,
                                            num_kv_blocks=100_000), cost)
        p99[policy] = calculate_metrics(res.records, res.duration).stats["tpot"].p(99)
    assert p99["chunked"] < 0.9 * p99["naive"]
    assert p99["chunked"] == pytest.approx(22.0, abs=0.5)  # every step is a pure memory-bound step


def test_linear_fit_recovers_the_coefficients_and_keeps_them_non_negative():
    rng = np.random.default_rng(0)
    true = [0.05, 0.002, 3e-6, 0.0006, 2e-8, 0.01]
    model = LinearCostModel(true)
    samples = []
    for _ in range(40):
        k = int(rng.integers(0, 4))
        comp = StepComposition(tuple(int(x) for x in rng.integers(10, 2000, rng.integers(0, 16))),
                               tuple((int(n), int(s)) for n, s in
                                     zip(rng.integers(1, 512, k), rng.integers(0, 3000, k))))
        samples.append((comp, model.step_time(comp)))
    fit = LinearCostModel.fit(samples)
    # no verify step among the samples: the draft and crossover terms get their defaults
    np.testing.assert_allclose(fit.coef, [*true, true[3], 0.0], rtol=1e-6)
    assert fit.coef == pytest.approx(model.coef, rel=1e-6)
    assert fit.defaulted == ("draft_tokens", "dense_step")
    assert fit.relative_errors(samples).max() < 1e-6
    # a feature that only hurts the fit is clamped to 0, not made negative
    neg = [(c, 0.05 + 0.001 * len(c.decode_contexts) - 1e-7 * sum(c.decode_contexts))
           for c, _ in samples]
    assert min(LinearCostModel.fit(neg).coef) >= 0
    with pytest.raises(ValueError, match="at least 6 samples"):  # the 6 features they have
        LinearCostModel.fit(samples[:5])


def test_roofline_cost_model_matches_the_calculators_bounds():
    from sloserve.roofline.hardware import get_hardware
    from sloserve.roofline.models import get_model
    spec, hw = get_model("Llama-3-70B"), get_hardware("H100-SXM")
    m = RooflineCostModel(spec, hw, tp=8, compute_eff=1.0, memory_eff=1.0)
    weights = m._per["weights"]
    # batch-1 decode at context 1: memory-bound, the weights (70B x 2 bytes, no embedding
    # table) plus a token's activations and KV, split over 8 GPUs
    t = m.step_time(StepComposition((1,), ()))
    assert t == pytest.approx(weights / hw.mem_bandwidth / 8, rel=0.01)
    assert 135e9 < weights < 141e9
    # a 1024-token prefill is compute-bound: ~2 x params x tokens FLOP
    t = m.step_time(StepComposition((), ((1024, 0),)))
    assert t == pytest.approx(2 * weights / 2 * 1024 / hw.peak("bf16") / 8, rel=0.1)
    # the memory-bound decode step absorbs a small chunk: adding 64 prefill tokens to 32
    # decodes costs far less than 64 tokens' share of a compute-bound prefill
    base = m.step_time(StepComposition((2048,) * 32, ()))
    mixed = m.step_time(StepComposition((2048,) * 32, ((64, 0),)))
    assert mixed < base * 1.05


def test_round_robin_cluster_equals_each_replica_simulated_alone():
    from sloserve.sim.simulator import simulate_cluster
    reqs = mixed_workload(LengthOnlyFactory(), 40, scale=0.25, seed=5)
    arr = arrival_times(40, 8.0, seed=5)
    cost = LinearCostModel([0.01, 0.001, 1e-6, 0.0005, 1e-8])
    cfg = SimConfig(max_num_batched_tokens=256)
    res = simulate_cluster(reqs, arr, cfg, cost, num_replicas=2, router="round-robin")
    order = sorted(range(40), key=lambda i: (arr[i], i))
    for j in (0, 1):
        mine = [i for pos, i in enumerate(order) if pos % 2 == j]
        assert sorted(i for i in range(40) if res.replica_of[i] == j) == sorted(mine)
        alone = simulate([reqs[i] for i in mine], [arr[i] for i in mine], cfg, cost)
        assert [res.records[i].chunk_times for i in mine] == [r.chunk_times for r in alone.records]


def test_routers_balance_and_keep_prefix_groups_together():
    from sloserve.bench.datasets import shared_prefix_workload
    from sloserve.sim.simulator import simulate_cluster
    reqs = shared_prefix_workload(LengthOnlyFactory(), 60, num_groups=3, prefix_len=64,
                                  suffix_len=8, output_len=8, seed=1)
    arr = arrival_times(60, 20.0, seed=1)
    cost = OverlapCostModel(0.02, 5000.0)
    res = simulate_cluster(reqs, arr, SimConfig(), cost, num_replicas=3, router="prefix-affinity")
    by_group = {}
    for r, rep in zip(reqs, res.replica_of):
        by_group.setdefault(r.tag, set()).add(rep)
    assert all(len(v) == 1 for v in by_group.values())
    busy = arrival_times(60, 500.0, seed=1)  # queues build: least-outstanding spreads them
    res = simulate_cluster(reqs, busy, SimConfig(), cost, num_replicas=3, router="least-outstanding")
    counts = [res.replica_of.count(j) for j in range(3)]
    assert max(counts) - min(counts) <= 6 and all(r.success for r in res.records)
    with pytest.raises(ValueError, match="router must be one of"):
        simulate_cluster(reqs, arr, SimConfig(), cost, 2, router="random")


def test_capacity_search_finds_the_rate_where_p99_ttft_crosses_the_slo():
    from sloserve.sim.simulator import find_capacity
    reqs = [SampleRequest("", 256, 32) for _ in range(300)]
    cost = OverlapCostModel(0.02, 20000.0)

    def run(rate):
        res = simulate(reqs, arrival_times(300, rate, process="constant"), SimConfig(), cost)
        return calculate_metrics(res.records, res.duration)

    def meets(m):
        return m.stats["ttft"].p(99) <= 200.0
    cap = find_capacity(run, meets, 1.0, 200.0, iters=10)
    assert cap is not None and meets(run(cap)) and not meets(run(cap * 1.15))
    assert find_capacity(run, lambda m: False, 1.0, 2.0) is None


def _steady(n=3000, rate=6.0, max_concurrency=None):
    reqs = mixed_workload(LengthOnlyFactory(), n, scale=0.5, seed=1)
    arr = arrival_times(n, rate, seed=1)
    res = simulate_cluster(reqs, arr, SimConfig(max_num_batched_tokens=512, num_kv_blocks=100_000),
                           OverlapCostModel(0.022, 35000.0), max_concurrency=max_concurrency)
    return reqs, arr, res


def test_littles_law_holds_on_a_steady_run():
    """L = lambda W (Little 1961): the time-average of requests in flight (from the event loop)
    equals the arrival rate times the mean E2E latency (from the records)."""
    _, arr, res = _steady()
    e2e = np.mean([r.latency for r in res.records])
    lam = len(arr) / res.duration
    assert res.mean_in_flight == pytest.approx(lam * e2e, rel=1e-9)  # the accounting is exact
    assert res.mean_in_flight == pytest.approx(6.0 * e2e, rel=0.05)  # and the offered rate


def test_closed_loop_never_has_more_than_max_concurrency_in_flight():
    reqs, arr, res = _steady(n=200, rate=float("inf"), max_concurrency=3)
    events = sorted([(r.send_time, 1) for r in res.records]
                    + [(r.send_time + r.latency, -1) for r in res.records],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 3
    assert 2.9 < res.mean_in_flight <= 3.0
    waits = [r.queue_time for r in res.records]
    assert min(waits) == 0.0 and max(waits) > 1.0  # later requests waited for a slot
    assert all(r.ttft > 0 for r in res.records)  # TTFT counts from the send, not the arrival


def test_closed_loop_frees_a_slot_when_the_client_has_the_last_token():
    reqs = [SampleRequest("", 16, 4) for _ in range(3)]
    cfg = SimConfig(request_in_s=0.03, token_out_s=0.05)
    res = simulate_cluster(reqs, [0.0] * 3, cfg, OverlapCostModel(0.01, 1600.0), max_concurrency=1)
    for a, b in zip(res.records, res.records[1:]):
        assert b.send_time == pytest.approx(a.send_time + a.latency)  # the client's view


def test_prefix_affinity_keeps_shared_prefix_groups_and_spreads_other_tags():
    mixed = mixed_workload(LengthOnlyFactory(), 40, scale=0.1, seed=0)  # tags short / long
    res = simulate_cluster(mixed, arrival_times(40, 5.0, seed=0), SimConfig(),
                           OverlapCostModel(0.02, 1e4), num_replicas=2, router="prefix-affinity")
    assert set(res.replica_of) == {0, 1}  # not pinned by the short/long tags


@pytest.mark.parametrize("pacing", [True, False])
def test_a_long_prompt_beside_a_decode_is_paced_by_the_cost_models_prices(pacing):
    """A 4 ms decode step and 0.2 ms a prompt token: beside the running decode, the
    2,000-token prompt (over 4 % of max_model_len 8,192) advances 16 tokens a step (one decode
    step's worth, 20, in whole 16s), and the decode's steps stay at 7.2 ms; with pacing off it
    takes the budget (511 tokens beside the decode) and the decode sits through 106 ms steps."""
    reqs = [SampleRequest("", 8, 300), SampleRequest("", 2000, 2)]
    cost = LinearCostModel([0.004, 0.0, 0.0, 0.0002, 0.0, 0.0])
    cfg = SimConfig(max_num_batched_tokens=512, max_model_len=8192, enable_prefill_pacing=pacing)
    res = simulate(reqs, [0.0, 0.1], cfg, cost, record_steps=True)
    beside = [sum(n for n, _ in c.prefill_chunks) for _, c in res.steps
              if c.decode_contexts and c.prefill_chunks]
    if pacing:
        assert beside == [16] * 125
    else:
        assert beside == [511, 511, 511, 467]
    assert [r.output_tokens for r in res.records] == [300, 2]
