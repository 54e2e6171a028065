"""``sloserve tune``: the grid simulated and ranked (the simulator's verdicts, so exact), the
goldilocks budget, refusals; ``--verify`` against live servers."""
from __future__ import annotations

import json

import pytest

from sloserve.sim.tune import Candidate, grid
from sloserve.sim.tune import main as tune_main

WORKLOAD = ["--dataset-name", "mixed", "--mixed-scale", "0.25", "--num-prompts", "40",
            "--request-rate", "2", "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
            "--goodput", "ttft:800", "tpot:40"]


def test_the_grid_is_ranked_by_predicted_goodput_and_names_the_goldilocks_budget(tmp_path,
                                                                                 capsys):
    out = tmp_path / "tune.json"
    assert tune_main([*WORKLOAD, "--budgets", "64,512,2048", "--max-num-seqs-grid", "8,64",
                      "--long-prefill-thresholds", "0", "--capacity-top", "1",
                      "--save-tune", str(out)]) == 0
    res = json.loads(out.read_text())
    ranked = res["ranked"]
    # 3 budgets x 2 seq caps x (whole, chunked paced, chunked unpaced), the defaults among them
    assert len(ranked) == 18 and [r["rank"] for r in ranked] == list(range(1, 19))
    keys = [(-round(r["goodput"], 9), -round(r["attainment"], 9)) for r in ranked]
    assert keys == sorted(keys)
    best_per_budget = {}
    for r in ranked:
        best_per_budget.setdefault(int(r["flags"][1]), r["goodput"])
    assert res["goldilocks_budget"] == int(ranked[0]["flags"][1])
    assert best_per_budget[res["goldilocks_budget"]] == pytest.approx(max(best_per_budget.values()),
                                                                      rel=1e-9)
    assert ranked[0]["capacity"] is None or ranked[0]["capacity"] > 0
    text = capsys.readouterr().out
    assert "(defaults)" in text and "<- goldilocks" in text
    assert text.strip().splitlines()[-1].startswith("pick: --max-num-batched-tokens ")


def test_ties_go_to_the_defaults_and_the_grid_holds_them():
    d = Candidate.defaults()
    assert d in grid([128], [16], [256])  # added when the grid misses it
    assert d.distance(d) == 0 and Candidate(128, 16).distance(d) == 2


def test_searched_flags_and_a_missing_slo_are_refused(capsys):
    assert tune_main([*WORKLOAD, "--max-num-batched-tokens", "256"]) == 2
    assert "tune searches the scheduler settings itself" in capsys.readouterr().err
    assert tune_main([a for a in WORKLOAD if a not in ("--goodput", "ttft:800", "tpot:40")]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_verify_serves_the_pick_and_the_defaults_and_measures_them(tmp_path, capsys):
    """One live check of the whole loop on the embedded model (a tiny workload; the numbers
    are the host's, only their presence and shape are asserted)."""
    out = tmp_path / "tune.json"
    # 600-token prompts: chunks of 256 and 512 and whole prompts are predicted apart
    assert tune_main(["--dataset-name", "random", "--random-input-len", "600",
                      "--random-output-len", "4", "--num-prompts", "4", "--request-rate", "4",
                      "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
                      "--goodput", "ttft:60000", "tpot:60000", "--budgets", "256",
                      "--max-num-seqs-grid", "8", "--long-prefill-thresholds", "0",
                      "--capacity-top", "0", "--verify", "1", "--serve-arg=--dtype",
                      "--serve-arg=float32", "--save-tune", str(out)]) == 0
    res = json.loads(out.read_text())
    verified = res["verified"]
    assert len(verified) == 2  # the pick (not the defaults here: chunks of 256), the defaults
    assert any(v["flags"] == Candidate.defaults().serve_flags() for v in verified)
    for v in verified:
        assert len(v["measured"]) == 1 and v["measured_attainment"] == 1.0
        assert v["measured_goodput"] > 0
    assert "predicted vs measured" in capsys.readouterr().out


def test_a_failed_verification_run_is_left_out_not_fatal(tmp_path, capsys):
    """A server that cannot start (here a flag it refuses) fails its runs, which are named
    with their log; the ranking is still printed and saved, with nothing measured."""
    out = tmp_path / "tune.json"
    assert tune_main(["--dataset-name", "random", "--random-input-len", "32",
                      "--random-output-len", "4", "--num-prompts", "4", "--request-rate", "4",
                      "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
                      "--goodput", "ttft:60000", "tpot:60000", "--budgets", "512",
                      "--max-num-seqs-grid", "64", "--long-prefill-thresholds", "0",
                      "--capacity-top", "0", "--verify", "1",
                      "--serve-arg=--no-such-flag", "--save-tune", str(out)]) == 0
    err = capsys.readouterr().err
    assert "tune: that run failed (sloserve serve exited with 2 before /health)" in err
    (v,) = json.loads(out.read_text())["verified"]
    assert v["measured"] == [] and v["measured_goodput"] is None


def test_instances_searches_replicas_against_prefill_decode_splits(tmp_path, capsys):
    """--instances 3: each configuration as 3 replicas (the defaults' layout) and as 1 + 2 and
    2 + 1 prefill / decode splits, all simulated and ranked; the layout flags and --verify are
    refused beside it."""
    out = tmp_path / "tune.json"
    base = ["--dataset-name", "mixed", "--mixed-scale", "0.1", "--num-prompts", "30",
            "--request-rate", "6", "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
            "--goodput", "ttft:800", "tpot:40", "--budgets", "256,512",
            "--max-num-seqs-grid", "64", "--long-prefill-thresholds", "0",
            "--capacity-top", "0"]
    assert tune_main([*base, "--instances", "3", "--save-tune", str(out)]) == 0
    res = json.loads(out.read_text())
    lays = {(r["layout"]["replicas"], r["layout"]["prefill"], r["layout"]["decode"])
            for r in res["ranked"]}
    assert lays == {(3, 0, 0), (1, 1, 2), (1, 2, 1)}
    assert len(res["ranked"]) == 3 * 2 * 3  # layouts x budgets x (whole, pacing on, off)
    (d,) = [r for r in res["ranked"] if r["defaults"]]
    assert d["layout"] == {"replicas": 3, "prefill": 0, "decode": 0}
    printed = capsys.readouterr().out
    assert "3 replicas: budget 512, seqs 64, chunked, pacing on, threshold none  (defaults)" \
        in printed
    assert "1 prefill + 2 decode: budget" in printed and "pick: " in printed
    for bad in (["--instances", "1"], ["--instances", "2", "--num-replicas", "2"],
                ["--instances", "2", "--verify", "1"]):
        assert tune_main([*base, *bad]) == 2
    err = capsys.readouterr().err
    assert "--instances must be 2..16" in err and "--num-replicas: --instances searches" in err
    assert "--verify serves one instance" in err


def test_verify_skips_a_configuration_predicted_as_one_above_it():
    from sloserve.sim.tune import distinct
    row = {"goodput": 1.0, "attainment": 0.9, "p99_ttft_ms": 10.0, "p99_tpot_ms": 5.0}
    rows = [(Candidate(512, 64), row), (Candidate(512, 16), dict(row)),
            (Candidate(256, 64), {**row, "goodput": 0.9}), (Candidate(128, 64), row)]
    assert [c for c, _ in distinct(rows, 2)] == [Candidate(512, 64), Candidate(256, 64)]
    assert len(distinct(rows, 5)) == 2


def test_the_scheduling_order_is_searched_when_requests_carry_priorities(tmp_path):
    """A trace whose short requests have priority 0 and long ones 1, arriving together: tune
    searches fcfs and priority (only fcfs without priorities, as the other tests' grids show),
    and the simulator schedules them apart (priority serves the short ones first: their P99
    TTFT is lower, the predictions differ)."""
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(24):
        long = i % 3 == 0
        lines.append(json.dumps({"arrival_time": i * 0.02, "input_len": 900 if long else 40,
                                 "output_len": 20, "priority": 1 if long else 0}))
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tune.json"
    assert tune_main(["--dataset-name", "trace", "--dataset-path", str(trace),
                      "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
                      "--goodput", "ttft:300", "tpot:40", "--budgets", "512",
                      "--max-num-seqs-grid", "64", "--long-prefill-thresholds", "0",
                      "--capacity-top", "0", "--save-tune", str(out)]) == 0
    ranked = json.loads(out.read_text())["ranked"]
    assert {r["flags"][-1] for r in ranked} == {"fcfs", "priority"} and len(ranked) == 6
    fcfs = next(r for r in ranked if r["defaults"])
    prio = next(r for r in ranked if r["flags"] == [*fcfs["flags"][:-1], "priority"])
    assert (prio["goodput"], prio["p99_ttft_ms"]) != (fcfs["goodput"], fcfs["p99_ttft_ms"])
    assert prio["goodput"] >= fcfs["goodput"] and prio["config"].endswith(", priority")


def test_bounds_of_verify_and_instances_and_a_trace_has_no_capacity(tmp_path, capsys):
    base = ["--dataset-name", "mixed", "--mixed-scale", "0.1", "--num-prompts", "10",
            "--request-rate", "3", "--decode-step-ms", "12", "--prefill-tokens-per-s", "6000",
            "--goodput", "ttft:800", "tpot:40", "--budgets", "512", "--max-num-seqs-grid", "64",
            "--long-prefill-thresholds", "0"]
    assert tune_main([*base, "--verify", "-1"]) == 2
    assert tune_main([*base, "--instances", "17"]) == 2
    err = capsys.readouterr().err
    assert "--verify must be >= 0, got -1" in err and "--instances must be 2..16" in err
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_time": i * 0.1, "input_len": 50,
                                         "output_len": 5}) + "\n" for i in range(8)))
    out = tmp_path / "tune.json"
    assert tune_main(["--dataset-name", "trace", "--dataset-path", str(trace),
                      *base[6:], "--save-tune", str(out)]) == 0
    res = json.loads(out.read_text())
    assert all("capacity" not in r for r in res["ranked"])  # a trace has no rate to bisect
    assert "at the trace's arrivals" in capsys.readouterr().err
