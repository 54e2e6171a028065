"""Prometheus exporter: vLLM metric names, counters and histogram counts after real requests, and
the StatLogger on synthetic records."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sloserve.engine.metrics import FinishedRequestStats, IterationStats
from sloserve.server.metrics import PrometheusStatLogger, build_1_2_5_buckets

VLLM_NAMES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "sloserve:engine_steps_total", "sloserve:batched_tokens_per_step_bucket",
    "sloserve:kv_cache_usage_peak_perc",
]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples, name, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels` (le buckets excluded)."""
    return sum(v for (n, lbl), v in samples.items()
               if n == name and all(dict(lbl).get(k) == x for k, x in labels.items())
               and "le" not in dict(lbl))


def test_metrics_after_requests(http, client, live_server):
    model = live_server.model
    # requests aborted by earlier tests are reported with the engine's next step: flush them
    client.completions.create(model=model, prompt="warm", max_tokens=1)
    r0 = http.get("/metrics")
    assert r0.status_code == 200 and r0.headers["content-type"].startswith("text/plain")
    before = _samples(r0.text)

    usages = []
    for prompt, n in (("The sky is", 3), ("Two plus two equals", 4)):
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True})
        usages.append(resp.usage)
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=2,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"

    text = http.get("/metrics").text
    for name in VLLM_NAMES:
        assert name in text, name
    after = _samples(text)

    def delta(name, **labels):
        return _get(after, name, model_name=model, **labels) - _get(before, name, model_name=model,
                                                                     **labels)

    n_req = 3
    prompt_tokens = sum(u.prompt_tokens for u in usages) + len(live_server.engine.tokenizer.encode("Hello"))
    gen_tokens = sum(u.completion_tokens for u in usages) + 2
    assert _get(after, "vllm:prompt_tokens_total", model_name=model) > 0
    assert _get(after, "vllm:generation_tokens_total", model_name=model) > 0
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == gen_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == n_req
    for h in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds",
              "vllm:request_decode_time_seconds", "vllm:request_time_per_output_token_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert delta(h + "_count") == n_req, h
    assert delta("vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == gen_tokens
    assert delta("vllm:inter_token_latency_seconds_count") == gen_tokens - n_req
    # over the server's whole life: every finished request is in every per-request histogram
    finished = _get(after, "vllm:request_success_total", model_name=model)
    assert _get(after, "vllm:e2e_request_latency_seconds_count", model_name=model) == finished
    assert _get(after, "vllm:request_generation_tokens_count", model_name=model) == finished
    steps = _get(after, "sloserve:engine_steps_total", model_name=model)
    assert steps > 0
    assert _get(after, "sloserve:batched_tokens_per_step_count", model_name=model) == steps
    assert 0 < _get(after, "sloserve:kv_cache_usage_peak_perc", model_name=model) <= 1
    assert 0 <= _get(after, "vllm:kv_cache_usage_perc", model_name=model) <= 1
    assert _get(after, "vllm:num_requests_running", model_name=model) == 0
    assert _get(after, "vllm:num_requests_waiting", model_name=model) == 0


def test_stat_logger_unit():
    a, b = PrometheusStatLogger(), PrometheusStatLogger()  # own registries: no name clash
    a.bind("m", max_model_len=100, max_num_batched_tokens=50)
    b.bind("other")
    it = IterationStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_prompt_tokens=7,
                        num_generation_tokens=2, num_batched_tokens=9, num_preemptions=1,
                        ttfts=[0.1], itls=[0.02])
    fin = FinishedRequestStats(finish_reason="stop", num_prompt_tokens=7, num_generation_tokens=3,
                               e2e_latency=0.5, queue_time=0.01, ttft=0.1, tpot=0.2,
                               prefill_time=0.09, decode_time=0.4)
    a.record(it, [fin])
    a.record(IterationStats(kv_cache_usage=0.1), [])
    s = _samples(a.render().decode())
    assert s[("vllm:num_requests_running", (("model_name", "m"),))] == 0
    assert _get(s, "vllm:num_preemptions_total") == 1
    assert _get(s, "vllm:prompt_tokens_total") == 7
    assert _get(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert _get(s, "vllm:request_success_total", finished_reason="length") == 0
    assert _get(s, "vllm:kv_cache_usage_perc") == 0.1
    assert _get(s, "sloserve:kv_cache_usage_peak_perc") == 0.25
    assert _get(s, "sloserve:engine_steps_total") == 2
    assert _get(s, "vllm:request_time_per_output_token_seconds_sum") == 0.2
    assert ("vllm:request_prompt_tokens_bucket", (("le", "100.0"), ("model_name", "m"))) in s
    assert _get(_samples(b.render().decode()), "vllm:prompt_tokens_total") == 0
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(2048)[-1] == 2000


def test_spec_decode_per_position_series_exist_from_the_start():
    """As vLLM: with k draft tokens the k per-position accepted counters exist (at 0) before
    any draft is accepted; without speculative decoding there are none."""
    spec, plain = PrometheusStatLogger(num_speculative_tokens=3), PrometheusStatLogger()
    spec.bind("m")
    plain.bind("m")
    s = _samples(spec.render().decode())
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert sorted(dict(lbl)["position"] for n, lbl in s if n == name) == ["0", "1", "2"]
    assert _get(s, name) == 0
    assert not [n for n, _ in _samples(plain.render().decode()) if n == name]


def test_http_requests_are_counted_by_endpoint_as_vllm_counts_them(http, live_server):
    """``http_requests_total{handler,method,status}`` (vLLM's per-endpoint counter, by route
    template): one request to each API and a 4xx, counted under its own handler; /metrics and
    /health are not counted."""
    model = live_server.model
    calls = [("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [
                 {"role": "user", "content": "hi"}]}, "2xx"),
             ("/v1/responses", {"model": model, "max_output_tokens": 2, "input": "hi"}, "2xx"),
             ("/v1/messages", {"model": model, "max_tokens": 2, "messages": [
                 {"role": "user", "content": "hi"}]}, "2xx"),
             ("/v1/messages", {"model": model, "messages": []}, "4xx")]

    def counts():
        s = _samples(http.get("/metrics").text)
        return {(dict(lbl)["handler"], dict(lbl)["method"], dict(lbl)["status"]): v
                for (n, lbl), v in s.items() if n == "http_requests_total"}
    before = counts()
    for path, body, _ in calls:
        http.post(path, json=body)
    http.get("/v1/responses/resp_unknown")
    http.get("/health")
    after = counts()
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grew == {("/v1/chat/completions", "POST", "2xx"): 1.0,
                    ("/v1/responses", "POST", "2xx"): 1.0,
                    ("/v1/messages", "POST", "2xx"): 1.0, ("/v1/messages", "POST", "4xx"): 1.0,
                    ("/v1/responses/{response_id}", "GET", "4xx"): 1.0}


def _fin(reason: str, ttft: float | None, tpot: float | None, e2e: float,
         tokens: int = 3) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, num_prompt_tokens=5,
                                num_generation_tokens=tokens, e2e_latency=e2e, queue_time=0.0,
                                ttft=ttft, tpot=tpot, prefill_time=0.0, decode_time=0.0)


def test_slo_counters_judge_each_finished_request_once():
    """--goodput ttft:500 tpot:50 e2el:2000: met, each reason missed (a request over several
    limits counted once, under the first), a 1-token request (no TPOT) met, aborted ones not
    judged; the limits are bucket edges and ITL/TPOT get edges below 10 ms."""
    m = PrometheusStatLogger(slos={"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0})
    m.bind("m")
    m.record(IterationStats(itls=[0.004, 0.006]), [
        _fin("stop", 0.5, 0.05, 2.0),            # at every limit: met
        _fin("length", 0.2, None, 0.2, 1),       # one token, no TPOT: met
        _fin("stop", 0.9, 0.09, 9.0),            # all three over: ttft
        _fin("stop", 0.1, 0.051, 1.0),           # tpot
        _fin("length", 0.1, 0.01, 2.5),          # e2el
        _fin("abort", 0.1, 0.01, 30.0),          # a client gone: not judged
        _fin("abort", None, None, 0.3)])
    s = _samples(m.render().decode())
    assert _get(s, "sloserve:requests_slo_met_total") == 2
    assert {r: _get(s, "sloserve:requests_slo_missed_total", reason=r)
            for r in ("ttft", "tpot", "e2el")} == {"ttft": 1, "tpot": 1, "e2el": 1}

    def edges(name):
        return sorted(float(dict(lbl)["le"]) for (n, lbl) in s if n == name + "_bucket"
                      and dict(lbl)["le"] != "+Inf")
    assert {0.5, 1.0, 2.5}.issubset(edges("vllm:time_to_first_token_seconds"))
    itl = edges("vllm:inter_token_latency_seconds")
    assert itl[:6] == [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025] and 0.05 in itl
    assert itl == edges("vllm:request_time_per_output_token_seconds")
    assert 2.0 in edges("vllm:e2e_request_latency_seconds")
    # without --goodput: vLLM's edges plus the fine ones, no SLO series judged
    plain = PrometheusStatLogger()
    plain.record(None, [_fin("stop", 0.5, 0.05, 2.0)])
    p = _samples(plain.render().decode())
    assert _get(p, "sloserve:requests_slo_met_total") == 0
    assert not [n for n, _ in p if n == "sloserve:requests_slo_missed_total"]


def test_stats_snapshot_is_the_scrape_at_its_sequence_and_its_window_is_exact():
    m = PrometheusStatLogger(slos={"ttft": 500.0})
    m.bind("m")
    ttfts = [0.1, 0.2, 0.3, 0.4, 0.9]
    m.record(IterationStats(num_generation_tokens=5, itls=[0.01, 0.03]),
             [_fin("stop", t, 0.02, t + 0.1) for t in ttfts])
    m.record(IterationStats(num_generation_tokens=1), [])
    snap, scraped = m.snapshot(), _samples(m.render().decode())
    assert snap["seq"] == 2 == _get(scraped, "sloserve:stats_sequence")
    flat = {}
    for name, v in snap["cumulative"].items():
        if isinstance(v, dict):
            flat.update({(name, k): x for k, x in v.items()})
        else:
            flat[(name, None)] = v
    for (name, lbl), value in scraped.items():
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        rest = [v for k, v in lbl if k != "model_name"]
        key = (name, rest[0] if len(rest) == 1 else None)
        assert flat[key] == value, key
    w = snap["window"]
    assert (w["requests"], w["slo_met"], w["slo_missed"]) == (5, 4, 1)
    assert w["attainment"] == 0.8
    # numpy's linear percentiles of 100..400, 900 ms
    assert w["ttft_ms"] == pytest.approx({"p50": 300.0, "p90": 700.0, "p99": 880.0})
    assert w["itl_ms"] == pytest.approx({"p50": 20.0, "p90": 28.0, "p99": 29.8})
    assert snap["slo_ms"] == {"ttft": 500.0}
