"""`sloserve sim`, `sloserve compare` and the profile file round trip."""
from __future__ import annotations

import json

import pytest

from sloserve.bench.compare import compare
from sloserve.bench.compare import main as compare_main
from sloserve.sim.cli import main as sim_main
from sloserve.sim.cost_model import LinearCostModel, StepComposition
from sloserve.sim.profile import fit_with_holdout, load_profile, save_profile



def test_sim_writes_a_bench_format_result_and_is_deterministic(tmp_path, capsys):
    args = ["--dataset-name", "mixed", "--num-prompts", "50", "--mixed-scale", "0.25",
            "--request-rate", "4", "--decode-step-ms", "22", "--prefill-tokens-per-s", "35000",
            "--goodput", "ttft:2000", "tpot:30"]
    assert sim_main([*args, "--save-result", str(tmp_path / "a.json")]) == 0
    assert sim_main([*args, "--save-result", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "Simulated Serving Benchmark Result" in out and "Successful requests:" in out
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    for k in ("ttfts", "itls", "output_lens", "mean_tpot_ms", "p99_ttft_ms", "duration"):
        assert a[k] == b[k], k
    assert a["completed"] == 50 and a["simulated"] is True and a["scheduling_policy"] == "chunked"
    assert a["mean_tpot_ms"] >= 22.0  # no step is shorter than the memory-bound decode step
    rows = {k: rel for k, _, _, rel in compare(a, b)}
    assert rows["mean_ttft_ms"] == 0.0
    assert compare_main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "| mean_ttft_ms |" in capsys.readouterr().out


@pytest.mark.parametrize("extra, msg", [
    ([], "either --profile"),
    (["--profile", "x.json", "--roofline-model", "Llama-3-8B"], "either --profile"),
    (["--decode-step-ms", "22"], "needs both"),
    (["--profile", "/nonexistent.json"], "nonexistent"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--num-prefill-instances", "1"],
     "needs both --num-prefill-instances"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--num-prefill-instances", "1",
      "--num-decode-instances", "1", "--kv-transfer-link", "carrier-pigeon"], "unknown link"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--num-prefill-instances", "1",
      "--num-decode-instances", "1", "--kv-transfer-link", "fast"],
     "known: nic-100g, nic-200g, nic-400g, nvlink; as a rate: expected a rate such as 0.4gbit"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--find-capacity",
      "--slo-attainment", "0.9"], "needs the per-request limits in --goodput"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--find-capacity",
      "--slo-attainment", "1.5", "--goodput", "ttft:100"], "must be in (0, 1]"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--step-overhead-ms", "nan"],
     "finite"),
    (["--roofline-model", "Llama-3-8B", "--step-overhead-ms", "-10"], "finite number of seconds"),
    (["--roofline-model", "Llama-3-8B", "--compute-efficiency", "1e-300"], "priced a step at"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--request-in-ms", "inf"],
     "server path"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--token-out-ms", "nan"],
     "server path"),
    (["--roofline-model", "Llama-3-71B"], "unknown model 'Llama-3-71B'"),
    (["--roofline-model", "Llama-3-8B", "--hardware", "A100-SXM"], "unknown hardware 'A100-SXM'"),
    (["--roofline-model", "Llama-3-8B", "--dtype", "bogus"], "unknown dtype"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--save-result", "/"], "/"),
    (["--preset", "lecture", "--find-capacity"], "different runs"),
    (["--preset", "lecture", "--scheduling-policy", "static"], "compares naive and chunked"),
    (["--preset", "lecture", "--profile", "p.json"], "compares naive and chunked"),
    (["--preset", "lecture", "--save-result", "x.json"], "for a single run"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--slo-p99-ttft-ms", "1"],
     "only apply with --find-capacity"),
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--find-capacity",
      "--capacity-range", "1,inf", "--slo-p99-ttft-ms", "100"], "must be finite"),
])
def test_sim_bad_settings_exit_2_with_one_line(extra, msg, capsys):
    assert sim_main(["--num-prompts", "3", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sloserve sim: error: ") and msg in err and err.count("\n") == 1


def test_profile_file_round_trip_and_holdout(tmp_path):
    model = LinearCostModel([0.05, 0.002, 3e-6, 0.0006, 2e-8, 0.01])
    samples = [(StepComposition((100 + i,) * (i % 5),
                                ((32 * (i % 4 + 1), 64 * i),) * (i % 3 + (i > 7))), 0.0)
               for i in range(16)]
    samples = [(c, model.step_time(c)) for c, _ in samples]
    fitted, err = fit_with_holdout(samples)
    assert len(err) == 4 and err.max() < 1e-6
    save_profile(str(tmp_path / "p.json"), samples, fitted, {"model": "x"})
    loaded = load_profile(str(tmp_path / "p.json"))
    assert loaded.coef == pytest.approx(model.coef, rel=1e-6)
    (tmp_path / "bad.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="not a `sloserve profile` file"):
        load_profile(str(tmp_path / "bad.json"))


def test_sim_with_the_roofline_model_of_70b_on_8_h100(capsys):
    assert sim_main(["--dataset-name", "mixed", "--num-prompts", "100", "--request-rate", "6",
                     "--roofline-model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "8",
                     "--num-kv-blocks", "200000"]) == 0
    out = capsys.readouterr()
    assert "roofline (Llama-3-70B on 8 x H100-SXM" in out.err and "Successful requests:" in out.out


def test_capacity_search_from_the_cli_chunked_beats_naive_in_the_lecture_regime(capsys):
    caps = {}
    for policy in ("naive", "chunked"):
        assert sim_main(["--dataset-name", "mixed", "--num-prompts", "150", "--decode-step-ms", "22",
                         "--prefill-tokens-per-s", "35000", "--scheduling-policy", policy,
                         "--num-kv-blocks", "100000", "--find-capacity", "--slo-p99-ttft-ms", "2000",
                         "--slo-p99-tpot-ms", "40", "--capacity-range", "0.5,60"]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith("capacity: ") and "meets P99 TTFT <= 2000 ms, P99 TPOT <= 40 ms" in line
        assert "the top of the range" not in line  # a capacity found, not the search's ceiling
        caps[policy] = float(line.split()[1])
    assert caps["chunked"] > 1.2 * caps["naive"]
    assert sim_main(["--num-prompts", "3", "--decode-step-ms", "22", "--prefill-tokens-per-s",
                     "35000", "--find-capacity"]) == 2


LECTURE = ["--dataset-name", "mixed", "--decode-step-ms", "22", "--prefill-tokens-per-s", "35000",
           "--num-kv-blocks", "100000"]


def test_lecture_preset_prints_naive_vs_chunked_and_chunking_cuts_the_tpot_tail(capsys):
    assert sim_main(["--preset", "lecture", "--num-prompts", "400"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [float(x) for x in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| naive") or line.startswith("| chunked")}
    assert "Poisson 6 req/s" in out and "budget 512" in out and "overlap (decode 22 ms" in out
    # columns: TPOT P50, P90, P99, TTFT mean, TTFT P99, output tok/s, preemptions
    assert rows["chunked"][2] < 0.9 * rows["naive"][2]
    assert rows["chunked"][2] == pytest.approx(22.0, abs=0.5)
    assert rows["chunked"][3] > rows["naive"][3]  # the price: long prompts wait for their chunks


def test_lecture_70b_preset_sizes_the_kv_cache_from_the_roofline_specs(capsys):
    assert sim_main(["--preset", "lecture-70b", "--num-prompts", "200"]) == 0
    out = capsys.readouterr().out
    # 90 % of 8 x 80 GiB minus 70.6e9 bf16 parameters, over 320 KiB of KV per token, 16 per block
    assert "Llama-3-70B on 8 x H100-SXM" in out and "91050 KV blocks of 16" in out
    assert sum(line.startswith(("| naive", "| chunked")) for line in out.splitlines()) == 2


def test_sim_sweep_writes_the_bench_sweep_table_and_pareto_plot(tmp_path, capsys):
    assert sim_main([*LECTURE, "--num-prompts", "200", "--request-rates", "2,6,20",
                     "--goodput", "ttft:2000", "tpot:40", "--result-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["point"] for r in sweep["rows"]] == [2.0, 6.0, 20.0]
    assert (tmp_path / "pareto.png").stat().st_size > 0 and "| request_rate |" in out
    tput = [r["output_throughput"] for r in sweep["rows"]]
    assert tput[0] < tput[1] < tput[2]


def test_capacity_with_an_attainment_target(capsys):
    base = [*LECTURE, "--num-prompts", "150", "--find-capacity", "--goodput", "ttft:2000",
            "tpot:40", "--capacity-range", "1,60"]
    assert sim_main([*base, "--slo-attainment", "0.9"]) == 0
    at90 = float(capsys.readouterr().out.split("capacity: ")[1].split(" req/s")[0])
    assert sim_main([*base, "--slo-attainment", "0.99"]) == 0
    out = capsys.readouterr().out
    at99 = float(out.split("capacity: ")[1].split(" req/s")[0])
    assert "99 % of requests within TTFT 2000 ms and TPOT 40 ms" in out
    assert 1 < at99 <= at90 < 60  # a stricter target admits no more load


def test_closed_loop_and_disaggregation_from_the_cli(capsys):
    assert sim_main([*LECTURE, "--num-prompts", "100", "--max-concurrency", "4",
                     "--request-rate", "inf"]) == 0
    err = capsys.readouterr().err
    in_flight = float(err.split("mean requests in flight ")[1].split(";")[0])
    assert 3.5 < in_flight <= 4.0
    assert sim_main([*LECTURE, "--num-prompts", "100", "--request-rate", "4",
                     "--num-prefill-instances", "1", "--num-decode-instances", "2",
                     "--kv-transfer-model", "Llama-3-8B", "--kv-transfer-link", "nic-100g",
                     "--kv-transfer-mode", "eager"]) == 0
    err = capsys.readouterr().err
    assert "1 prefill + 2 decode instances (KV over nic-100g at 12.50 GB/s per NIC, shared, " \
           "eager)" in err
    assert "KV transfer exposed mean" in err
    assert sim_main([*LECTURE, "--num-prompts", "5", "--request-rate", "4",
                     "--num-prefill-instances", "1", "--num-decode-instances", "1",
                     "--kv-transfer-link", "0.4gbit"]) == 0
    assert "(KV over 0.4gbit at 50.00 MB/s per NIC, shared, layerwise)" in capsys.readouterr().err


def test_a_five_coefficient_profile_gets_a_zero_per_chunk_term(tmp_path):
    """... and, as a profile of before the verify terms, draft tokens priced as prefill tokens
    and no dense-GEMM crossover."""
    (tmp_path / "old.json").write_text('{"coef": [0.05, 0.002, 3e-6, 0.0006, 2e-8]}')
    old = load_profile(str(tmp_path / "old.json"))
    assert old.coef == [0.05, 0.002, 3e-6, 0.0006, 2e-8, 0.0, 0.0006, 0.0]
    assert old.quantized_step_max_tokens == 0
    assert old.defaulted == ("prefill_chunks", "draft_tokens", "dense_step")
    with pytest.raises(ValueError, match="need 8 coefficients"):
        LinearCostModel([1.0, 2.0])


def test_trace_replay_refuses_rate_searches_and_an_empty_trace(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text('{"arrival_time": 0, "input_len": 8, "output_len": 4}\n')
    (tmp_path / "e.jsonl").write_text("")
    base = ["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--dataset-name", "trace"]
    assert sim_main([*base, "--dataset-path", str(tmp_path / "t.jsonl"), "--find-capacity",
                     "--slo-p99-ttft-ms", "100"]) == 2
    assert "replays its own arrival times" in capsys.readouterr().err
    assert sim_main([*base, "--dataset-path", str(tmp_path / "e.jsonl")]) == 2
    assert "no requests" in capsys.readouterr().err


def test_preset_table_counts_failures_and_exits_1(capsys):
    assert sim_main(["--preset", "lecture", "--num-prompts", "20", "--num-kv-blocks", "50"]) == 1
    out = capsys.readouterr().out
    assert "| failed |" in out and "requests failed (over max_model_len or the KV cache)" in out


def test_flags_are_parsed_once_and_never_abbreviated(capsys):
    """`--find-cap --request-rates 1,2` used to run a capacity search that ignored the rates
    (the check re-read argv and missed the abbreviation): now an abbreviation is an error."""
    with pytest.raises(SystemExit) as e:
        sim_main([*LECTURE, "--find-cap", "--request-rates", "1,2"])
    assert e.value.code == 2
    assert "unrecognized arguments: --find-cap" in capsys.readouterr().err
    assert sim_main([*LECTURE, "--find-capacity", "--request-rates", "1,2"]) == 2
    assert "--find-capacity and --request-rates are different runs" in capsys.readouterr().err


def test_default_kv_cache_is_what_1_gib_holds_for_the_model_simulated(capsys):
    from sloserve.sim.capacity import kv_blocks
    from sloserve.sim.simulator import SimConfig
    assert SimConfig().num_kv_blocks == kv_blocks(1.0, "SmolLM2-135M", "bf16", 16) == 2912
    assert kv_blocks(2.0, "SmolLM2-135M", "bf16", 16) == 5825
    overlap = [a for a in LECTURE if a not in ("--num-kv-blocks", "100000")]
    assert sim_main([*overlap, "--num-prompts", "20", "--kv-cache-memory", "0.01"]) == 0
    # 0.01 GiB of SmolLM2 KV: 29 blocks of 16 = 464 tokens, so max_model_len is capped there
    # and the mixed workload's long prompts (2048 and 4096 tokens) are refused
    out = capsys.readouterr()
    assert "policy chunked" in out.err
    assert "Failed requests:                        10" in out.out


def test_sim_reports_the_bench_metrics_and_percentiles_asked_for(capsys, tmp_path):
    """The stall chunking removes is a per-token interval: the simulator prints ITL and max ITL
    like `sloserve bench`, and takes vLLM's --percentile-metrics / --metric-percentiles."""
    out = tmp_path / "r.json"
    assert sim_main([*LECTURE, "--num-prompts", "60", "--request-rate", "6", "--percentile-metrics",
                     "itl,ttft", "--metric-percentiles", "50,99.9", "--save-result", str(out)]) == 0
    text = capsys.readouterr().out
    assert "P99.9 ITL (ms):" in text and "Max ITL (ms):" in text and "P50 TTFT (ms):" in text
    assert "TPOT" not in text.split("Time to First Token")[1]  # tpot not asked for
    saved = json.loads(out.read_text())
    assert "p99.9_itl_ms" in saved and "p50_ttft_ms" in saved and "mean_tpot_ms" not in saved
    assert sim_main([*LECTURE, "--num-prompts", "5", "--percentile-metrics", "itl,ttfb"]) == 2
    assert "--percentile-metrics: unknown ['ttfb']" in capsys.readouterr().err
