"""Prefix caching and overload control through the HTTP API: cached-token usage, cache_salt,
POST /reset_prefix_cache, the vLLM prefix-cache counters, priority validation, and 429 with
Retry-After past --max-waiting-requests (on the completions, Messages and Responses APIs, each in
its own error shape) while admitted requests finish intact."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from sloserve.config import EngineConfig

SYSTEM = "You are a terse assistant who answers in one line. " * 12  # ~130 tokens


def _complete(http, prompt, **kw):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                           **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _counter(http, name) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_repeated_prefix_is_served_from_the_cache(http):
    http.post("/reset_prefix_cache").raise_for_status()
    q0, h0 = (_counter(http, "vllm:prefix_cache_queries_total"),
              _counter(http, "vllm:prefix_cache_hits_total"))
    cold = _complete(http, SYSTEM + "Q: 2+2?")
    warm = _complete(http, SYSTEM + "Q: 3+5?")
    n = cold["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < warm["usage"]["prompt_tokens"]
    again = _complete(http, SYSTEM + "Q: 2+2?")
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]  # greedy: same answer
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    time.sleep(0.3)  # the core's snapshot after the last step
    assert _counter(http, "vllm:prefix_cache_hits_total") - h0 >= cached
    assert _counter(http, "vllm:prefix_cache_queries_total") - q0 >= 3 * n - 8


def test_salts_and_a_reset_keep_requests_apart(http):
    _complete(http, SYSTEM + "salted", cache_salt="tenant-a")
    other = _complete(http, SYSTEM + "salted", cache_salt="tenant-b")
    same = _complete(http, SYSTEM + "salted", cache_salt="tenant-a")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert http.post("/reset_prefix_cache").status_code == 200
    after = _complete(http, SYSTEM + "salted", cache_salt="tenant-a")
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_bad_cache_salt_and_priority_are_400(http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": None})
    assert r.status_code == 200  # null: the default, as for the other optional fields


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 60  # a hang guard, not a speed bound
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_past_the_queue_limit_requests_get_429_at_once_and_admitted_ones_finish(helpers):
    srv = helpers.start_server(EngineConfig(dtype="float32", num_kv_blocks=256, max_model_len=1024,
                                            max_num_seqs=1, max_waiting_requests=2))
    try:
        base = srv.base_url
        done: dict[int, httpx.Response] = {}

        def run(i, n):
            done[i] = httpx.post(base + "/v1/completions", timeout=600, json={
                "prompt": f"Story {i}:", "max_tokens": n, "temperature": 0, "ignore_eos": True})
        first = threading.Thread(target=run, args=(0, 300))
        first.start()
        _wait_for(lambda: srv.engine.stats.num_running == 1, "the first request never ran")
        queued = [threading.Thread(target=run, args=(i, 8)) for i in (1, 2)]
        for t in queued:
            t.start()
        # both queued behind the one running request
        _wait_for(lambda: srv.engine.stats.num_waiting == 2, "the two were not queued")
        r = httpx.post(base + "/v1/completions", timeout=60,
                       json={"prompt": "one more", "max_tokens": 4})
        # answered at once, not after the running request: that one is still generating
        assert first.is_alive()
        assert r.status_code == 429, r.text
        body = r.json()["error"]
        assert body["type"] == "RateLimitError" and body["code"] == 429
        assert "2 requests are waiting, the limit is 2" in body["message"]
        assert int(r.headers["Retry-After"]) >= 1
        # the other APIs refuse the same way, each in its own error shape
        model = srv.engine.model_name
        r = httpx.post(base + "/v1/messages", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
        r = httpx.post(base + "/v1/responses", timeout=60, json={
            "model": model, "max_output_tokens": 4, "input": "hi"})
        assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError", r.text
        for t in (first, *queued):
            t.join(timeout=600)
        assert [done[i].status_code for i in range(3)] == [200, 200, 200]
        assert done[0].json()["usage"]["completion_tokens"] == 300
        assert httpx.post(base + "/v1/completions", timeout=60,
                          json={"prompt": "now", "max_tokens": 2}).status_code == 200
        assert 'sloserve:requests_rejected_total{model_name="' in httpx.get(base + "/metrics").text
    finally:
        srv.stop()
