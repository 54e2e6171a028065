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
    (["--decode-step-ms", "22", "--prefill-tokens-per-s", "1000", "--max-concurrency", "2"],
     "not simulated yet"),
])
def test_sim_bad_settings_exit_2_with_one_line(extra, msg, capsys):
    assert sim_main(["--num-prompts", "3", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sloserve sim: error: ") and msg in err and err.count("\n") == 1


def test_profile_file_round_trip_and_holdout(tmp_path):
    model = LinearCostModel([0.05, 0.002, 3e-6, 0.0006, 2e-8])
    samples = [(StepComposition((100 + i,) * (i % 5), ((32 * (i % 4 + 1), 64 * i),)),
                0.0) for i in range(12)]
    samples = [(c, model.step_time(c)) for c, _ in samples]
    fitted, err = fit_with_holdout(samples)
    assert len(err) == 3 and err.max() < 1e-6
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
        assert sim_main(["--dataset-name", "mixed", "--num-prompts", "300", "--decode-step-ms", "22",
                         "--prefill-tokens-per-s", "35000", "--scheduling-policy", policy,
                         "--num-kv-blocks", "100000", "--find-capacity", "--slo-p99-ttft-ms", "2000",
                         "--slo-p99-tpot-ms", "40", "--capacity-range", "0.5,30"]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith("capacity: ") and "meets P99 TTFT <= 2000 ms, P99 TPOT <= 40 ms" in line
        caps[policy] = float(line.split()[1])
    assert caps["chunked"] > 1.2 * caps["naive"]
    assert sim_main(["--num-prompts", "3", "--decode-step-ms", "22", "--prefill-tokens-per-s",
                     "35000", "--find-capacity"]) == 2
