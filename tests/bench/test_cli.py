"""``sloserve bench`` / ``sloserve bench sweep`` end to end against the mock server."""
from __future__ import annotations

import json
import os
import socket

import pytest

import sloserve.bench.tokenizer as bench_tokenizer_mod
from sloserve.bench.cli import main

from .mock_server import DEFAULT_PROMPT_TOKENS, MODEL_ID, http_error
from .test_results import VLLM_DETAILED_RESULT_KEYS, VLLM_RESULT_KEYS


@pytest.fixture
def fast_tokenizer(monkeypatch, bench_tokenizer, gguf_path):
    """Make the CLI's tokenizer loading reuse the session's tokenizer (loading takes ~3 s)."""
    real = bench_tokenizer_mod.load_tokenizer

    def load(path):
        return bench_tokenizer if path == gguf_path else real(path)

    monkeypatch.setattr(bench_tokenizer_mod, "load_tokenizer", load)


def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def common(mock, gguf_path, *extra):
    return ["--base-url", mock.base_url, "--tokenizer", gguf_path, "--disable-tqdm",
            "--dataset-name", "random", "--random-input-len", "8", "--random-output-len", "4",
            "--num-prompts", "5", *extra]


def test_bench_saves_vllm_result(mock_server, gguf_path, tmp_path, capsys):
    before = len(mock_server.received)
    rc = main(common(mock_server, gguf_path, "--save-result", "--result-dir", str(tmp_path),
                     "--result-filename", "out.json", "--label", "mylabel"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    path = tmp_path / "out.json"
    assert f"result: {path}" in out
    assert "Serving Benchmark Result" in out
    d = json.loads(path.read_text())
    assert list(d) == VLLM_RESULT_KEYS
    assert (d["model_id"], d["tokenizer_id"], d["label"]) == (MODEL_ID, gguf_path, "mylabel")
    assert (d["backend"], d["endpoint_type"]) == ("openai", "openai")
    assert (d["num_prompts"], d["completed"], d["failed"]) == (5, 5, 0)
    assert d["total_input_tokens"] == 5 * DEFAULT_PROMPT_TOKENS  # the server's usage.prompt_tokens
    assert d["total_output_tokens"] == 20           # the mock answers min(max_tokens, 4) = 4 with usage
    assert d["request_rate"] == "inf" and d["max_concurrency"] is None and d["burstiness"] == 1.0
    assert d["request_goodput"] is None
    got = mock_server.received[before:]
    assert len(got) == 6                             # initial test + 5
    assert all(p == "/v1/completions" for p, _ in got)
    assert sorted(b["max_tokens"] for _, b in got) == [2, 4, 4, 4, 4, 4]
    assert all(b["model"] == MODEL_ID and b["temperature"] == 0.0 for _, b in got)
    assert "ignore_eos" not in got[0][1]


def test_bench_default_result_filename(mock_server, gguf_path, tmp_path, capsys, fast_tokenizer):
    rc = main(common(mock_server, gguf_path, "--save-result", "--result-dir", str(tmp_path),
                     "--skip-initial-test", "--request-rate", "50"))
    assert rc == 0
    (name,) = os.listdir(tmp_path)
    assert name.startswith(f"openai-50qps-{MODEL_ID}-") and name.endswith(".json")


def test_bench_chat_detailed_goodput_plots(mock_server, gguf_path, tmp_path, capsys, fast_tokenizer):
    before = len(mock_server.received)
    plots = tmp_path / "plots"
    rc = main(common(mock_server, gguf_path, "--backend", "openai-chat", "--save-detailed",
                     "--result-dir", str(tmp_path), "--result-filename", "d.json", "--plot-dir", str(plots),
                     "--goodput", "ttft:600000", "tpot:600000", "--ignore-eos", "--skip-initial-test",
                     "--max-concurrency", "2"))
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads((tmp_path / "d.json").read_text())
    assert list(d) == VLLM_DETAILED_RESULT_KEYS
    assert d["backend"] == "openai-chat" and d["max_concurrency"] == 2
    assert d["completed"] == 5 and d["request_goodput"] == pytest.approx(5 / d["duration"], rel=1e-12)
    assert d["input_lens"] == [DEFAULT_PROMPT_TOKENS] * 5 and d["output_lens"] == [4] * 5
    assert sum(q > 0 for q in d["queue_times"]) >= 1  # 5 requests at once through 2 slots
    assert "Good requests:" in out
    got = mock_server.received[before:]
    assert len(got) == 5
    assert all(p == "/v1/chat/completions" and b["ignore_eos"] is True for p, b in got)
    for f in ("cdf.png", "itl_timeline.png"):
        data = (plots / f).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000


def test_sweep_writes_table_json_and_plot(mock_server, gguf_path, tmp_path, capsys, fast_tokenizer):
    rc = main(["sweep", *common(mock_server, gguf_path, "--result-dir", str(tmp_path),
                                "--request-rates", "20,inf", "--goodput", "ttft:600000")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(["sweep-request_rate-20.json", "sweep-request_rate-inf.json",
                                                   "sweep.md", "sweep.json", "pareto.png"])
    s = json.loads((tmp_path / "sweep.json").read_text())
    assert s["axis"] == "request_rate" and s["slos"] == {"ttft": 600000.0}
    assert [r["point"] for r in s["rows"]] == [20.0, "inf"]  # strict JSON, as vLLM writes rates
    assert s["operating_point"] == "inf"  # both points meet a 10 min TTFT
    assert all(r["completed"] == 5 and r["failed"] == 0 for r in s["rows"])
    assert "operating point: request_rate = inf" in out
    table = (tmp_path / "sweep.md").read_text().splitlines()
    assert table[0].startswith("| request_rate |") and len(table) == 4


def test_sweep_json_is_strict_json(mock_server, gguf_path, tmp_path, capsys, fast_tokenizer):
    """sweep.json must be plain JSON (like the result files, which write an infinite rate as
    "inf"): no bare Infinity that jq, JavaScript or strict parsers reject."""
    rc = main(["sweep", *common(mock_server, gguf_path, "--result-dir", str(tmp_path), "--num-prompts", "2",
                                "--request-rates", "inf", "--goodput", "ttft:600000", "--skip-initial-test")])
    assert rc == 0

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    json.loads((tmp_path / "sweep.json").read_text(), parse_constant=reject)


# --- bad settings ------------------------------------------------------------------------------

def _one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return lines[-1]


@pytest.mark.parametrize("flag, value, match", [
    ("--request-rate", "0", "request rate must be > 0"),
    ("--request-rate", "fast", "request rate must be a number"),
    ("--num-prompts", "0", "expected an integer >= 1"),
    ("--burstiness", "0", "expected a finite number > 0"),
    ("--max-concurrency", "-1", "expected an integer >= 1"),
    ("--random-prefix-len", "-1", "expected an integer >= 0"),
    ("--mixed-short-lens", "1,x", "comma-separated integers"),
])
def test_bad_flag_values_exit_2(mock_server, gguf_path, capsys, flag, value, match):
    with pytest.raises(SystemExit) as ei:
        main(common(mock_server, gguf_path, flag, value))
    assert ei.value.code == 2
    last = _one_line(capsys.readouterr().err)
    assert last.startswith("sloserve bench: error: argument " + flag) and match in last


@pytest.mark.parametrize("extra, match", [
    (["--goodput", "foo"], "goodput SLO must look like NAME:MS"),
    (["--goodput", "ttft:500", "itl:5"], "must be ttft, tpot or e2el"),
    (["--random-range-ratio", "1.0"], "random-range-ratio"),
    (["--temperature", "-1"], "--temperature"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--tokenizer", "/nonexistent/tok.gguf"], "does not exist"),
])
def test_bad_settings_return_2_with_one_line(mock_server, gguf_path, capsys, fast_tokenizer, extra, match):
    before = mock_server.num_generation_requests()
    rc = main(common(mock_server, gguf_path, *extra))
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0, err          # exactly one line
    assert err.startswith("sloserve bench: error: ") and match in err
    assert mock_server.num_generation_requests() == before  # nothing was sent


def test_unreachable_server_returns_2(gguf_path, capsys):
    rc = main(["--base-url", f"http://127.0.0.1:{dead_port()}", "--tokenizer", gguf_path,
               "--num-prompts", "1", "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("sloserve bench: error: cannot list models at http://127.0.0.1:")
    assert err.strip().count("\n") == 0


@pytest.mark.parametrize("skip_test", [False, True])
def test_failing_server_returns_1(mock_server, gguf_path, capsys, fast_tokenizer, monkeypatch, skip_test):
    monkeypatch.setattr(mock_server, "default", http_error(503, "mock is down"))
    before = mock_server.num_generation_requests()
    rc = main(common(mock_server, gguf_path, *(["--skip-initial-test"] if skip_test else [])))
    out, err = capsys.readouterr()
    assert rc == 1
    if skip_test:  # the run happens; every request failed
        assert mock_server.num_generation_requests() - before == 5
        assert f"{'Failed requests:':<40}{'5':<20}" in out.splitlines()
        assert "mock is down" in out
    else:  # stopped by the initial test request, with the server's message
        assert mock_server.num_generation_requests() - before == 1
        last = _one_line(err)
        assert last.startswith("sloserve bench: error: initial test request to ") and "mock is down" in last


def test_bad_goodput_is_rejected_before_contacting_the_server(gguf_path, capsys):
    """A flag typo should be reported as such even when the server is down (it is validated only
    after /v1/models is listed and the workload is built)."""
    rc = main(["--base-url", f"http://127.0.0.1:{dead_port()}", "--tokenizer", gguf_path,
               "--num-prompts", "1", "--disable-tqdm", "--goodput", "foo"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "goodput SLO must look like NAME:MS" in err, err


@pytest.mark.parametrize("extra, match", [
    (["--percentile-metrics", "ttft,bogus"], "--percentile-metrics"),
    (["--metric-percentiles", "50,150"], "percentiles"),
])
def test_bad_output_flags_are_rejected_before_the_run(mock_server, gguf_path, capsys, fast_tokenizer,
                                                      extra, match):
    """A typo in an output flag should fail fast, not after the whole benchmark ran (whose result
    is then lost: nothing is saved)."""
    before = mock_server.num_generation_requests()
    rc = main(common(mock_server, gguf_path, *extra))
    err = capsys.readouterr().err
    assert rc == 2
    assert match in err
    assert mock_server.num_generation_requests() == before, "the benchmark ran before the flag was checked"


# --- tokenizer resolution -------------------------------------------------------------------------

def test_server_models_and_tokenizer_fallback(mock_server, gguf_path, tmp_path, fast_tokenizer, bench_tokenizer):
    from sloserve.bench.tokenizer import resolve_tokenizer, server_models
    from sloserve.embedded import default_model_path

    models = server_models(mock_server.base_url + "/")
    assert [m["id"] for m in models] == [MODEL_ID]
    # the served model's root is no local path: the embedded GGUF
    tok, tok_id = resolve_tokenizer(None, models, MODEL_ID)
    assert tok_id == default_model_path() == gguf_path and tok is bench_tokenizer
    # a usable root of the served model wins; another model's root is ignored
    assert resolve_tokenizer(None, [{"id": MODEL_ID, "root": gguf_path}], MODEL_ID)[1] == gguf_path
    empty = tmp_path / "no-tokenizer-files"
    empty.mkdir()
    assert resolve_tokenizer(None, [{"id": MODEL_ID, "root": str(empty)}], MODEL_ID)[1] == gguf_path
    # --tokenizer wins, and must exist
    assert resolve_tokenizer(gguf_path, [{"id": MODEL_ID, "root": str(empty)}], MODEL_ID)[1] == gguf_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_tokenizer(str(tmp_path / "missing.gguf"), models, MODEL_ID)


def test_server_models_unreachable():
    from sloserve.bench.tokenizer import server_models
    with pytest.raises(ConnectionError, match="cannot list models"):
        server_models(f"http://127.0.0.1:{dead_port()}", timeout_s=2)


def test_sweep_needs_exactly_one_axis(mock_server, gguf_path, tmp_path, capsys, fast_tokenizer):
    base = ["sweep", *common(mock_server, gguf_path, "--result-dir", str(tmp_path))]
    for extra in ([], ["--request-rates", "1", "--max-concurrencies", "2"]):
        assert main(base + extra) == 2
        assert _one_line(capsys.readouterr().err) == (
            "sloserve bench: error: give exactly one of --request-rates and --max-concurrencies")
    with pytest.raises(SystemExit) as ei:
        main(base + ["--request-rates", "1,0"])
    assert ei.value.code == 2
