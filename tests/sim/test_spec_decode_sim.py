"""Speculative decoding in the simulator: verify steps priced by the cost model (draft tokens,
the dense-GEMM crossover), the modelled executor's acceptance, the engine's own drafter rules,
and per-request records that count tokens."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from sloserve.bench.arrivals import arrival_times
from sloserve.bench.datasets import mixed_workload
from sloserve.config import SpeculativeConfig
from sloserve.engine.metrics import StepTraceLogger
from sloserve.sim.cli import main as sim_main
from sloserve.sim.cost_model import (FEATURES, LinearCostModel, OverlapCostModel,
                                     RooflineCostModel, StepComposition)
from sloserve.sim.executor import SimDrafter, verify_cost
from sloserve.sim.profile import _step_row, fit_with_holdout, load_profile, save_profile
from sloserve.sim.simulator import SimConfig, simulate, simulate_cluster
from sloserve.sim.workload import LengthOnlyFactory
from sloserve.spec_decode.drafter import Drafter
from sloserve.step_io import ScheduledRequest, SchedulerOutput
from sloserve.workload import SampleRequest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VERIFY_COST = os.path.join(REPO, "benchmarks", "results", "spec_decode_2026-12-06",
                           "verify_cost_amx.json")
NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
#: c0..c7 of a profiled model with the verify terms; the crossover past 16 tokens a step
COEF = [0.004, 0.0004, 1e-6, 0.0002, 5e-8, 0.002, 0.0003, 0.008]
QMAX = 16


def _spec(**kw) -> SpeculativeConfig:
    base = {"method": "suffix", "num_speculative_tokens": 4} if kw.get("method") == "suffix" \
        else NGRAM4
    return SpeculativeConfig.parse({**base, **kw})


def _cfg(spec=None, rate=0.0, **kw) -> SimConfig:
    return SimConfig(num_kv_blocks=100_000, speculative=spec, spec_acceptance_rate=rate, **kw)


# ----------------------------------------------------------------------------- the cost model
def test_step_composition_of_a_verify_step_counts_its_drafts():
    greedy = None
    out = SchedulerOutput([
        ScheduledRequest("a", 40, 5, [1] * 5, [0], greedy, True, True, spec_token_ids=[1] * 4),
        ScheduledRequest("b", 30, 1, [1], [1], greedy, True, True),
        ScheduledRequest("c", 0, 8, [1] * 8, [2], greedy, False, False)])
    comp = StepComposition.of(out)
    assert comp == StepComposition((45, 31), ((8, 0),), (4, 0))
    assert comp.num_drafts == 4 and comp.num_tokens == 2 + 4 + 8
    # no drafts: the composition of before (and equal to one built without them)
    assert StepComposition((31,), (), (0,)) == StepComposition((31,)) \
        and StepComposition((31,), (), (0,)).decode_drafts == ()
    f = comp.features(QMAX)
    assert list(f) == [1, 2, 76, 8, 64, 1, 4, 0]  # 14 tokens: on the quantized kernels
    assert StepComposition((45, 31), ((8, 0),), (4, 3)).features(QMAX)[-1] == 1  # 17 tokens
    assert StepComposition((45, 31), ((8, 0),), (4, 3)).features(0)[-1] == 0  # no crossover
    with pytest.raises(ValueError, match="for each of the 2 decodes"):
        StepComposition((45, 31), (), (4,))


def test_verify_tokens_are_priced_and_the_crossover_is_a_step_cost():
    m = LinearCostModel(COEF, QMAX)
    decode = StepComposition((256,))
    for k in (1, 4, 8):
        verify = StepComposition((256 + k,), (), (k,))
        # what k drafts add to a decode: k query rows and k more context (their KV)
        assert m.step_time(verify) - m.step_time(decode) == pytest.approx(k * (COEF[6] + COEF[2]))
    # batch 4: k = 2 is 12 tokens (quantized), k = 4 is 20 (dense: the crossover's cost too)
    b4 = StepComposition((256,) * 4)
    k2, k4 = (StepComposition((256 + k,) * 4, (), (k,) * 4) for k in (2, 4))
    assert m.step_time(k2) - m.step_time(b4) == pytest.approx(8 * (COEF[6] + COEF[2]))
    assert m.step_time(k4) - m.step_time(b4) == pytest.approx(16 * (COEF[6] + COEF[2]) + COEF[7])
    # the other models price drafts too: compute that rides in the memory-bound step, FLOP
    ov = OverlapCostModel(0.02, 1000.0)
    assert ov.step_time(StepComposition((256,), (), (4,))) == pytest.approx(0.02)
    assert ov.step_time(StepComposition((256,) * 8, (), (4,) * 8)) == pytest.approx(0.032)
    from sloserve.roofline.hardware import get_hardware
    from sloserve.roofline.models import get_model
    rf = RooflineCostModel(get_model("Llama-3-8B"), get_hardware("H100-SXM"))
    assert rf.step_time(StepComposition((4000,) * 64, (), (4,) * 64)) \
        > rf.step_time(StepComposition((4000,) * 64))


#: ``sloserve profile`` on the quiet AMX host (2 CPUs), with its verify grid: quantized limit 16
GRID_PROFILE = os.path.join(os.path.dirname(__file__), "data", "profile_amx_grid_2026-12-06.json")


def test_the_fitted_profile_prices_a_verify_step_between_its_decode_and_the_matching_prefill():
    """Per the coefficients fitted on the AMX host: k drafts make a decode dearer, by more
    past the quantized limit, and stay cheaper than prefilling the same tokens (one chunk of
    1 + k tokens per request at the same position: each chunk pays its fixed cost)."""
    m = load_profile(GRID_PROFILE)
    assert m.quantized_step_max_tokens == 16 and m.defaulted == ()
    c = dict(zip(FEATURES, m.coef))
    assert c["draft_tokens"] > 0 and c["dense_step"] > 0
    for b in (1, 4, 16):
        decode = StepComposition((256,) * b)
        last = 0.0
        for k in (1, 2, 4, 8):
            verify = StepComposition((256 + k,) * b, (), (k,) * b)
            prefill = StepComposition((), ((1 + k, 255),) * b)
            t = m.step_time(verify)
            assert m.step_time(decode) < t < m.step_time(prefill)
            assert t > last
            last = t
            crossed = c["dense_step"] if b * (1 + k) > 16 >= b else 0.0
            assert t - m.step_time(decode) == pytest.approx(
                b * k * (c["draft_tokens"] + c["decode_context_tokens"]) + crossed)
    # the fit is the profile's own: refitting its samples gives its coefficients
    d = json.load(open(GRID_PROFILE))
    samples = [(StepComposition(tuple(s["composition"]["decode_contexts"]),
                                tuple(map(tuple, s["composition"]["prefill_chunks"])),
                                tuple(s["composition"]["decode_drafts"])), s["seconds"])
               for s in d["samples"]]
    assert LinearCostModel.fit(samples, 16).coef == pytest.approx(m.coef, rel=1e-6)
    assert m.relative_errors(samples).mean() < 0.1


def _verify_cost_samples():
    """(composition, seconds) of every measured cell of benchmarks/verify_cost.py on the AMX
    host (median of its rounds; context 256 + the step's drafts, as the scheduler counts it)."""
    d = json.load(open(VERIFY_COST))
    return [(StepComposition((d["context"] + r["k"],) * r["batch"], (), (r["k"],) * r["batch"]),
             float(np.median(r["step_ms"])) / 1e3) for r in d["rows"]]


def test_a_fit_to_the_measured_verify_steps_prices_drafts_and_the_dense_crossover():
    """benchmarks/verify_cost.py on the AMX host (quantized limit 16 tokens a step): the fitted
    draft-token and crossover coefficients are positive, and the fitted model has what the
    measurement shows: a verify step costs more than the decode step of its batch, more so
    past the limit (batch 4: k = 2 is 12 tokens, k = 4 is 20)."""
    samples = _verify_cost_samples()
    m = LinearCostModel.fit(samples, QMAX)
    assert m.coef[FEATURES.index("draft_tokens")] > 0 and m.coef[FEATURES.index("dense_step")] > 0
    assert m.defaulted == ()
    price = {(len(c.decode_contexts), c.decode_drafts[0] if c.decode_drafts else 0): m.step_time(c)
             for c, _ in samples}
    for b in (1, 4, 16):
        assert all(price[b, k] > price[b, 0] for k in (1, 2, 4, 8))
    jump = (price[4, 4] - price[4, 2]) / (price[4, 2] - price[4, 1])  # 8 rows + the crossover
    assert jump > 3  # vs 4 rows: more than twice the per-row slope
    assert m.relative_errors(samples).mean() < 0.25


def test_a_profile_with_verify_terms_round_trips_and_an_old_one_gets_the_defaults(tmp_path):
    true = LinearCostModel(COEF, QMAX)
    # chunks of 4 to 12 tokens, on either side of the limit; verify steps past it without one
    # (where every chunk step crosses the limit, the two step costs cannot be told apart)
    comps = [StepComposition((100 + i,) * (i % 5 + 1), ((4 * (i % 3 + 1), 16 * i),) * (i % 2),
                             tuple((i + j) % 6 for j in range(i % 5 + 1))) for i in range(24)]
    samples = [(c, true.step_time(c)) for c in comps]
    fitted, err = fit_with_holdout(samples, QMAX)
    assert fitted.coef == pytest.approx(COEF, rel=1e-6) and err.max() < 1e-6
    assert fitted.defaulted == ()
    save_profile(str(tmp_path / "p.json"), samples, fitted, {"model": "x"})
    loaded = load_profile(str(tmp_path / "p.json"))
    assert loaded.coef == pytest.approx(COEF, rel=1e-6) and loaded.quantized_step_max_tokens == 16
    # written before the verify terms: draft tokens priced as prefill tokens, no crossover
    (tmp_path / "old.json").write_text(json.dumps({"coef": COEF[:6]}))
    old = load_profile(str(tmp_path / "old.json"))
    assert old.coef == [*COEF[:6], COEF[3], 0.0] and old.defaulted == ("draft_tokens", "dense_step")
    (tmp_path / "bad.json").write_text(json.dumps({"coef": COEF, "quantized_step_max_tokens": -1}))
    with pytest.raises(ValueError, match="bad.json: quantized_step_max_tokens"):
        load_profile(str(tmp_path / "bad.json"))


def test_step_trace_lines_carry_the_drafts_of_a_verify_step_only(tmp_path):
    path = str(tmp_path / "t.jsonl")
    log = StepTraceLogger(path)
    step = SimpleNamespace(start_time=1.0, step_s=0.01, num_draft_tokens=3,
                           num_accepted_draft_tokens=2)
    stats = SimpleNamespace(num_running=2, num_waiting=0)
    verify = SchedulerOutput([
        ScheduledRequest("a", 40, 4, [1] * 4, [0], None, True, True, spec_token_ids=[1] * 3),
        ScheduledRequest("b", 30, 1, [1], [1], None, True, True)])
    plain = SchedulerOutput([ScheduledRequest("b", 31, 1, [1], [1], None, True, True)])
    log.record(verify, step, stats, [])
    log.record(plain, step, stats, [])
    log.close()
    rows = [json.loads(line) for line in open(path)]
    assert rows[0]["decode_drafts"] == [3, 0] and "decode_drafts" not in rows[1]
    assert (rows[0]["num_draft_tokens"], rows[0]["num_accepted_draft_tokens"]) == (3, 2)
    assert "num_draft_tokens" not in rows[1]
    assert [_step_row(r)[3] for r in rows] == [StepComposition.of(verify),
                                              StepComposition.of(plain)]
    assert _step_row(rows[0])[3].decode_drafts == (3, 0)


def test_a_served_engines_trace_records_its_verify_steps(tiny_llama_dir, tmp_path):
    """The real engine with n-gram drafts (repetitive prompts: the n-grams match): every trace
    line is the step's composition, drafts included, as the profiler reads it back."""
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.sampling_params import SamplingParams

    from .helpers import record_compositions
    path = str(tmp_path / "trace.jsonl")
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64,
                                 block_size=4, max_num_batched_tokens=64,
                                 speculative_config=dict(  # drafts at any measured cost
                                     NGRAM4, prompt_lookup_min=1,
                                     num_speculative_tokens_per_batch_size=[[1, 64, 4]])),
                    step_trace=path)
    comps = record_compositions(eng)
    for i in range(2):
        eng.add_request([10 + i + j % 3 for j in range(18)],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.core.close()
    rows = [_step_row(json.loads(line))[3] for line in open(path)]
    assert rows == comps and any(c.decode_drafts for c in rows)


def test_profile_fits_a_trace_with_verify_steps_at_the_given_limit(tmp_path, capsys):
    from sloserve.sim.profile import main as profile_main
    true = LinearCostModel(COEF, QMAX)
    rows, t = [], 0.0
    for i in range(40):  # a busy engine: each step starts when the one before ends
        comp = StepComposition((60 + i,) * (1 + i % 4), ((8 * (1 + i % 3), 0),) * (i % 5 == 0),
                               tuple((i + j) % 5 for j in range(1 + i % 4)))
        dt = true.step_time(comp)
        row = {"t": t, "step_s": dt, "running": 4, "waiting": 0,
               "decode_contexts": list(comp.decode_contexts),
               "prefill_chunks": [list(c) for c in comp.prefill_chunks], "admitted": []}
        if comp.decode_drafts:
            row["decode_drafts"] = list(comp.decode_drafts)
        rows.append(json.dumps(row))
        t += dt
    (tmp_path / "t.jsonl").write_text("\n".join(rows) + "\n")
    out = str(tmp_path / "p.json")
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl"), "--out", out,
                         "--quantized-step-max-tokens", "16"]) == 0
    assert "dense_step: a step of over 16 tokens" in capsys.readouterr().out
    m = load_profile(out)
    assert m.quantized_step_max_tokens == 16 and m.coef == pytest.approx(COEF, rel=1e-5)
    assert profile_main(["--quantized-step-max-tokens", "16"]) == 2
    assert "goes with --from-trace" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the simulator
def test_the_sim_drafter_follows_the_engines_k_and_floor():
    for spec in (_spec(), _spec(method="suffix"), _spec(num_speculative_tokens=8),
                 _spec(num_speculative_tokens_per_batch_size=[[1, 2, 3], [3, 9, 0]])):
        for qmax in (0, 16, 6):
            real, sim = Drafter(spec, qmax), SimDrafter(spec, qmax)
            for b in range(1, 12):
                assert sim.k_for(b) == real.k_for(b)
                drafts = sim.propose("r", [1] * 40, 30, 100, b)
                assert drafts == [1] * real.k_for(b)
    sim = SimDrafter(_spec())
    assert sim.propose("r", [1] * 40, 30, 2, 1) == [1, 1]  # at most what max_tokens leaves
    for _ in range(8):  # 32 draft tokens, none accepted: below the 10 % floor
        sim.observe("r", 4, 0, 10)
    assert sim.propose("r", [1] * 40, 30, 100, 1) == []  # off for the next 32 output tokens
    assert sim.propose("r", [1] * 72, 30, 100, 1) == [1] * 4
    sim.finish("r")


def test_acceptance_one_gives_k_plus_one_tokens_per_step_at_batch_one():
    """One request, 21 tokens: the prefill's token, then 4 verify steps of 4 drafts, each
    accepted whole: 5 tokens a step."""
    cost = LinearCostModel(COEF, QMAX)
    res = simulate([SampleRequest("", 32, 21)], [0.0], _cfg(_spec(), 1.0), cost, record_steps=True)
    rec = res.records[0]
    assert [c.decode_drafts for _, c in res.steps] == [(), (4,), (4,), (4,), (4,)]
    assert rec.output_tokens == 21 and len(rec.chunk_times) == 5
    assert (res.num_drafts, res.num_draft_tokens, res.num_accepted_tokens) == (4, 16, 16)
    verify_s = [cost.step_time(c) for _, c in res.steps[1:]]
    assert rec.itl == pytest.approx(verify_s)  # one gap per step: its tokens come together
    assert rec.tpot == pytest.approx(sum(verify_s) / 20)  # per token
    assert "acceptance 100.0 %, mean acceptance length 5.00" in res.spec_summary()


def _arrivals_at_zero(n=6):
    prompts, outputs = [20, 33, 12, 40, 25, 18][:n], [30, 17, 41, 9, 26, 35][:n]
    return [SampleRequest("", p, o) for p, o in zip(prompts, outputs)], [0.0] * n


def test_acceptance_zero_is_spec_off_plus_the_drafts_cost():
    """Every draft rejected: the same steps and tokens as without drafts (the scheduling does
    not change), each step dearer by exactly its draft tokens' price (rows, their KV, and the
    crossover where they push the step past it)."""
    reqs, arr = _arrivals_at_zero()
    cost = LinearCostModel(COEF, QMAX)
    spec = _spec(num_speculative_tokens_per_batch_size=[[1, 64, 4]], min_acceptance_rate=0.0)
    off = simulate(reqs, arr, _cfg(), cost, record_steps=True)
    on = simulate(reqs, arr, _cfg(spec, 0.0), cost, record_steps=True)
    assert len(on.steps) == len(off.steps) and on.num_draft_tokens > 0 == on.num_accepted_tokens
    crossed = 0
    for (_, a), (_, b) in zip(off.steps, on.steps):
        drafts = b.decode_drafts or (0,) * len(b.decode_contexts)
        assert a == StepComposition(tuple(c - d for c, d in zip(b.decode_contexts, drafts)),
                                    b.prefill_chunks)
        extra = b.num_drafts * (COEF[6] + COEF[2])
        if b.num_tokens > QMAX >= a.num_tokens:
            extra += COEF[7]
            crossed += 1
        assert cost.step_time(b) - cost.step_time(a) == pytest.approx(extra)
    assert crossed > 0
    dt = [e - s for (s, _), (e, _) in zip([(0.0, None)] + off.steps, off.steps)]
    dt_on = [e - s for (s, _), (e, _) in zip([(0.0, None)] + on.steps, on.steps)]
    assert dt_on == pytest.approx([d + cost.step_time(b) - cost.step_time(a)
                                   for d, (_, a), (_, b) in zip(dt, off.steps, on.steps)])
    for r_off, r_on in zip(off.records, on.records):
        assert r_on.output_tokens == r_off.output_tokens and \
            len(r_on.chunk_times) == len(r_off.chunk_times)
        assert r_on.tpot > r_off.tpot


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.737, 0.88, 1.0])
def test_output_tokens_equal_max_tokens_and_tpot_is_per_token(rate):
    reqs = mixed_workload(LengthOnlyFactory(), 60, scale=0.25, seed=7)
    arr = arrival_times(60, 3.0, seed=7)
    spec = _spec(num_speculative_tokens_per_batch_size=[[1, 8, 4]])
    res = simulate(reqs, arr, _cfg(spec, rate, max_num_batched_tokens=256),
                   LinearCostModel(COEF, QMAX), record_steps=True)
    assert all(r.success for r in res.records)
    assert [r.output_tokens for r in res.records] == [r.expected_output_len for r in reqs]
    assert sum(n for _, c in res.steps for n, _ in c.prefill_chunks) == \
        sum(r.prompt_len for r in reqs)
    assert res.num_draft_tokens > 0
    for r in res.records:
        assert len(r.itl) == len(r.chunk_times) - 1 <= r.output_tokens - 1
        if r.output_tokens > 1:
            assert r.tpot == pytest.approx((r.latency - r.ttft) / (r.output_tokens - 1))
    if rate == 1.0:  # every verify step gives k + 1 tokens but where max_tokens cuts its drafts
        assert res.num_accepted_tokens == res.num_draft_tokens
    if rate == 0.0:
        assert all(len(r.chunk_times) == r.output_tokens for r in res.records)
    # the same seed gives the same draws; the acceptance is as asked
    again = simulate(reqs, arr, _cfg(spec, rate, max_num_batched_tokens=256),
                     LinearCostModel(COEF, QMAX))
    assert [r.chunk_times for r in again.records] == [r.chunk_times for r in res.records]
    if 0 < rate < 1:  # P(first draft accepted) = rate, over hundreds of verifies
        assert abs(res.num_accepted_tokens / res.num_draft_tokens
                   - (rate - rate ** 5) / (4 * (1 - rate))) < 0.1


def test_disaggregated_and_replicated_runs_count_every_token():
    reqs = mixed_workload(LengthOnlyFactory(), 40, scale=0.25, seed=2)
    arr = arrival_times(40, 4.0, seed=2)
    cfg = _cfg(_spec(), 0.8)
    from sloserve.sim.kv_transfer import Disaggregation, KVTransferModel
    dis = Disaggregation(1, 2, KVTransferModel(1e5, 25e9, 30, "eager", 0.0))
    for kw in ({"num_replicas": 2}, {"disaggregation": dis}):
        res = simulate_cluster(reqs, arr, cfg, LinearCostModel(COEF, QMAX), **kw)
        assert [r.output_tokens for r in res.records] == [r.expected_output_len for r in reqs]
        assert res.num_accepted_tokens > 0


def test_the_default_switch_off_leaves_big_batches_without_drafts():
    """No per-batch table: the engine's rule on the cost model's prices (k per request from its
    acceptance and what drafts cost, every step within the quantized limit of 16 tokens): 8
    requests decoding together take at most one draft each, one alone takes 4."""
    reqs, arr = [SampleRequest("", 16, 40) for _ in range(8)], [0.0] * 8
    res = simulate(reqs, arr, _cfg(_spec(), 0.5), LinearCostModel(COEF, QMAX), record_steps=True)
    for _, c in res.steps:
        n = len(c.decode_contexts)
        if n >= 8:
            assert max(c.decode_drafts, default=0) <= 1
            assert c.num_tokens <= QMAX
        if c.decode_drafts:
            cost = LinearCostModel(COEF, QMAX)
            assert max(c.decode_drafts) <= Drafter(_spec(), QMAX, verify_cost(cost)).k_for(n)
    solo = simulate(reqs[:1], [0.0], _cfg(_spec(), 0.5), LinearCostModel(COEF, QMAX),
                    record_steps=True)
    assert max(d for _, c in solo.steps for d in c.decode_drafts) == 4
    # the cost model's quantized limit is the simulated worker's: 4 tokens a step, k = 3
    solo = simulate(reqs[:1], [0.0], _cfg(_spec(), 0.5), LinearCostModel(COEF, 4),
                    record_steps=True)
    assert max(d for _, c in solo.steps for d in c.decode_drafts) == 3


# ----------------------------------------------------------------------------- the CLI
BASE = ["--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "20",
        "--num-prompts", "4", "--max-concurrency", "1", "--request-rate", "inf",
        "--decode-step-ms", "5", "--prefill-tokens-per-s", "2000"]


@pytest.mark.parametrize("extra, msg", [
    (["--spec-acceptance-rate", "0.5"], "--spec-acceptance-rate only applies with"),
    (["--speculative-config", json.dumps(NGRAM4)], "needs --spec-acceptance-rate"),
    (["--speculative-config", json.dumps(NGRAM4), "--spec-acceptance-rate", "1.5"],
     "must be in [0, 1], got 1.5"),
    (["--speculative-config", json.dumps(NGRAM4), "--spec-acceptance-rate", "nan"],
     "must be in [0, 1]"),
    (["--speculative-config", "{not json", "--spec-acceptance-rate", "0.5"], "not valid JSON"),
    (["--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}',
      "--spec-acceptance-rate", "0.5"], "method must be one of"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
      "--spec-acceptance-rate", "0.5"], "needs prompt_lookup_max"),
])
def test_spec_flags_are_validated(extra, msg, capsys):
    assert sim_main([*BASE, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sloserve sim: error: ") and msg in err and err.count("\n") == 1


def test_sim_with_drafts_reports_them_and_writes_token_counts(tmp_path, capsys):
    out = str(tmp_path / "r.json")
    assert sim_main([*BASE, "--save-result", out]) == 0
    off = json.load(open(out))
    assert sim_main([*BASE, "--speculative-config", json.dumps(NGRAM4),
                     "--spec-acceptance-rate", "1", "--save-result", out]) == 0
    err = capsys.readouterr().err
    assert "speculative decoding: ngram, k=4" in err and "acceptance 100.0 %" in err
    on = json.load(open(out))
    assert on["output_lens"] == off["output_lens"] == [20] * 4
    assert on["total_output_tokens"] == off["total_output_tokens"] == 80
    # 1 + 4 + 5 x 3 tokens: drafts ride free in the overlap model's memory-bound step
    assert [len(i) for i in on["itls"]] == [4] * 4 and [len(i) for i in off["itls"]] == [19] * 4
    assert on["mean_tpot_ms"] == pytest.approx(off["mean_tpot_ms"] * 4 / 19)
