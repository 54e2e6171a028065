"""`sloserve serve --step-trace` records and `sloserve profile --from-trace`: the trace holds the
scheduler's step compositions, the fit uses only steps the engine was busy after, and the
server path (send -> engine, step end -> client) is measured per request."""
from __future__ import annotations

import json

import pytest

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams
from sloserve.sim.cost_model import StepComposition
from sloserve.sim.cost_model import OverlapCostModel
from sloserve.sim.profile import (frontend_delays, load_frontend, load_profile, main as profile_main,
                                  trace_samples)
from sloserve.sim.simulator import SimConfig, simulate
from sloserve.workload import SampleRequest

from .helpers import record_compositions

PROMPTS = [5, 37, 12]
OUTPUTS = [4, 3, 6]


def test_step_trace_records_every_step_and_its_composition(tiny_llama_dir, tmp_path):
    path = str(tmp_path / "trace.jsonl")
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64,
                                 block_size=4, max_num_batched_tokens=16,
                                 enable_prefix_caching=False), step_trace=path)
    comps = record_compositions(eng)
    for i, (p, o) in enumerate(zip(PROMPTS, OUTPUTS)):
        eng.add_request([10 + j for j in range(p)],
                        SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.core.close()
    rows = [json.loads(line) for line in open(path)]
    assert [StepComposition(tuple(r["decode_contexts"]), tuple(map(tuple, r["prefill_chunks"])))
            for r in rows] == comps
    assert sorted(n for r in rows for _, n in r["admitted"]) == sorted(PROMPTS)
    assert sum(n for r in rows for n, _ in r["prefill_chunks"]) == sum(PROMPTS)
    assert sum(len(r["decode_contexts"]) for r in rows) == sum(o - 1 for o in OUTPUTS)
    # the ids name each chunk's request: per request, contiguous chunks from 0 to its prompt end
    lengths = {rid: n for r in rows for (_, n), rid in zip(r["admitted"], r["admitted_ids"])}
    assert sorted(lengths.values()) == sorted(PROMPTS)
    ends = dict.fromkeys(lengths, 0)
    for r in rows:
        assert len(r["prefill_ids"]) == len(r["prefill_chunks"])
        for (n, start), rid in zip(r["prefill_chunks"], r["prefill_ids"]):
            assert start == ends[rid]
            ends[rid] = start + n
    assert ends == lengths
    ts = [r["t"] for r in rows]
    assert ts == sorted(ts) and rows[-1]["running"] + rows[-1]["waiting"] == 0
    samples = trace_samples([path])
    assert len(samples) == len(rows) - 1  # the last step was followed by idle time
    assert [c for c, _ in samples] == comps[:-1]
    assert all(t == pytest.approx(b["t"] - a["t"]) for (_, t), a, b in zip(samples, rows, rows[1:]))


def _line(t, busy, dec, pre):
    return json.dumps({"t": t, "step_s": 0.0, "running": busy, "waiting": 0,
                       "decode_contexts": dec, "prefill_chunks": pre, "admitted": []})


def test_profile_from_trace_fits_the_busy_cycles(tmp_path, capsys):
    # cycles that follow t = 0.05 + 0.002 * decodes + 0.001 * prefill tokens exactly
    lines, t = [], 0.0
    for k in range(40):
        dec, pre = [100 + k] * (k % 7), ([[16 * (k % 5 + 1), 0]] if k % 3 else [])
        lines.append(_line(t, 1, dec, pre))
        t += 0.05 + 0.002 * len(dec) + 0.001 * sum(n for n, _ in pre)
        if k == 20:  # idle after this step: its cycle is not a step cost
            lines.append(_line(t, 0, [1], []))
            t += 5.0
    lines.append(_line(t, 0, [], [[1, 0]]))
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "p.json"
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl"), "--out", str(out)]) == 0
    assert "40 busy steps from 1 trace(s)" in capsys.readouterr().out
    coef = load_profile(str(out)).coef
    assert coef[0] == pytest.approx(0.05, abs=1e-9) and coef[1] == pytest.approx(0.002, abs=1e-9)
    assert coef[3] == pytest.approx(0.001, abs=1e-9)


def test_profile_from_a_bad_trace_names_the_line(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text(_line(0.0, 1, [], []) + "\n{\"t\": 1}\n")
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl")]) == 2
    assert "t.jsonl:2: bad step-trace record" in capsys.readouterr().err


def test_server_path_delays_are_matched_per_request_and_used_by_the_simulator(tmp_path, capsys):
    # two requests: sent at 10.0 and 10.5; the engine saw them 30 ms later; prefill steps of
    # 200 ms (whole prompt) and the first token reached the client 10 ms after the step's end
    rows = [{"t": 10.04, "step_s": 0.2, "running": 1, "waiting": 0, "decode_contexts": [],
             "prefill_chunks": [[64, 0]], "admitted": [[10.03, 64]]},
            {"t": 10.53, "step_s": 0.2, "running": 0, "waiting": 0, "decode_contexts": [],
             "prefill_chunks": [[32, 0]], "admitted": [[10.53, 32]]}]
    rows[1:1] = [{"t": 10.24 + 0.05 * k, "step_s": 0.05, "running": 1, "waiting": 0,
                  "decode_contexts": [65 + k], "prefill_chunks": [], "admitted": []}
                 for k in range(6)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    res = {"start_times": [10.0, 10.5], "input_lens": [64, 32], "errors": ["", ""],
           "ttfts": [0.25, 0.24]}
    (tmp_path / "r.json").write_text(json.dumps(res))
    into, out = frontend_delays(str(tmp_path / "t.jsonl"), str(tmp_path / "r.json"))
    assert into == pytest.approx([0.03, 0.03]) and out == pytest.approx([0.01, 0.01])
    # a request of the second's length (sent at 10.45) whose token came 20 ms later, before
    # the step of that length ended (10.73): not that admission's; it is left out, and the
    # admission stays for the request that made it
    bad = {k: v + [x] for (k, v), x in zip(res.items(), (10.45, 32, "", 0.02))}
    (tmp_path / "r2.json").write_text(json.dumps(bad))
    assert frontend_delays(str(tmp_path / "t.jsonl"), str(tmp_path / "r2.json")) == (into, out)
    p = str(tmp_path / "p.json")
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl"), "--bench-result",
                         str(tmp_path / "r.json"), "--out", p]) == 0
    assert "send -> engine queue 30.0 ms, step end -> client 10.0 ms" in capsys.readouterr().out
    assert load_frontend(p) == pytest.approx((0.03, 0.01))
    # the simulator adds both to a request alone: TTFT = in + the step + out
    cfg = SimConfig(request_in_s=0.03, token_out_s=0.01)
    r = simulate([SampleRequest("", 64, 3)], [0.0], cfg, OverlapCostModel(0.02, 320.0))
    assert r.records[0].ttft == pytest.approx(0.03 + 0.2 + 0.01)
    assert r.records[0].itl == pytest.approx([0.02, 0.02])
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl"), "--bench-result",
                         str(tmp_path / "r.json"), str(tmp_path / "r.json")]) == 2
    assert "one file per trace" in capsys.readouterr().err


def test_an_idle_gap_after_an_abort_is_not_a_step_cost(tmp_path):
    rows = [_line(0.0, 1, [10], []), _line(0.1, 1, [11], []), _line(9.0, 1, [], [[4, 0]]),
            _line(9.2, 0, [5], [])]  # step_s 0 in _line: the gaps are the whole cycles
    (tmp_path / "t.jsonl").write_text("\n".join(rows) + "\n")
    samples = trace_samples([str(tmp_path / "t.jsonl")])
    # the step at 0.1 s said "1 running", but an abort left nothing to run until 9.0 s
    assert [round(t, 6) for _, t in samples] == [0.1, 0.2]


def test_profile_refuses_a_bench_result_of_another_run(tmp_path, capsys):
    rows = [{"t": 10.0 + 0.1 * k, "step_s": 0.09, "running": 1, "waiting": 0,
             "decode_contexts": [8 + k] * (k % 3), "prefill_chunks": [[8, 0]] if k == 0 else [],
             "admitted": [[10.0, 8]] if k == 0 else []} for k in range(12)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "r.json").write_text(json.dumps({"start_times": [-990.0], "input_lens": [8],
                                                 "ttfts": [0.1], "errors": [""]}))
    assert profile_main(["--from-trace", str(tmp_path / "t.jsonl"), "--bench-result",
                         str(tmp_path / "r.json")]) == 2
    assert "does not look like the run of" in capsys.readouterr().err
    assert profile_main(["--bench-result", str(tmp_path / "r.json")]) == 2
    assert "--bench-result goes with --from-trace" in capsys.readouterr().err
