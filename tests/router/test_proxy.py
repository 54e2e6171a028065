"""The router's OpenAI front over stub replicas: policies' choices through HTTP, bodies passed
through unchanged, streaming passed through as SSE, /v1/models, /health, /metrics, errors."""
from __future__ import annotations

import json

from .stubs import served_by, sse_events


def test_round_robin_alternates_and_passes_the_body_through(stub, live_router):
    a, b = stub("a"), stub("b")
    r = live_router(replicas=[a.url, b.url], routing_policy="round-robin")
    body = {"model": "stub", "prompt": "hello", "max_tokens": 5, "temperature": 0,
            "extra_field": {"kept": True}}
    got = [served_by(r.client.post("/v1/completions", json=body)) for _ in range(4)]
    assert got == ["a", "b", "a", "b"]
    assert [b_ for _, b_ in a.bodies] == [body, body]
    assert a.bodies[0][0] == "/v1/completions"


def test_least_outstanding_prefers_the_idle_replica(stub, live_router):
    a, b = stub("a"), stub("b")
    a.stream_forever = True
    r = live_router(replicas=[a.url, b.url], routing_policy="least-outstanding")
    body = {"prompt": "x", "stream": True}
    with r.client.stream("POST", "/v1/completions", json=body) as held:
        lines = held.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(lines)  # a now has one request in flight
        assert [served_by(r.client.post("/v1/completions", json={"prompt": "y"}))
                for _ in range(3)] == ["b", "b", "b"]
        assert r.router.pool.workers[0].outstanding == 1
    r.wait_for(lambda: r.router.pool.workers[0].outstanding == 0)


def test_streaming_is_passed_through_as_events(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url])
    for path, body in (("/v1/completions", {"prompt": "p", "stream": True}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "stream": True})):
        with r.client.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        texts = [c["choices"][0].get("text") or c["choices"][0]["delta"]["content"]
                 for c in chunks]
        assert texts == ["a-0", "a-1", "a-2"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_models_health_and_metrics(stub, live_router):
    a, b = stub("a"), stub("b")
    r = live_router(replicas=[a.url, b.url])
    resp = r.client.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] in "ab"
    assert r.client.get("/v1/models").json()["data"][0]["id"] == "stub"
    h = r.client.get("/health")
    assert h.status_code == 200
    assert h.json()["policy"] == "least-outstanding"
    assert {w["url"]: w["state"] for w in h.json()["workers"]} == {a.url: "healthy",
                                                                  b.url: "healthy"}
    text = r.client.get("/metrics").text
    assert 'sloserve_router_requests_total{role="replica",worker="' in text
    assert f'sloserve_router_worker_healthy{{role="replica",worker="{a.url}"}} 1.0' in text
    assert f'sloserve_router_outstanding_requests{{role="replica",worker="{b.url}"}} 0.0' in text


def test_errors_are_openai_shaped_and_worker_errors_pass_through(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url])
    resp = r.client.post("/v1/completions", content=b"{not json")
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert r.client.post("/v1/completions", json=[1, 2]).status_code == 400
    assert r.client.get("/nowhere").json()["error"]["code"] == 404
    a.fail_status = 422
    resp = r.client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert resp.status_code == 422 and resp.json()["error"]["message"] == "a refuses"


def test_no_healthy_worker_is_a_503(stub, live_router):
    a = stub("a")
    a.health_status = 503  # draining: answers, takes nothing new
    r = live_router(replicas=[a.url])
    assert r.states() == {a.url: "unhealthy"}
    h = r.client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "unavailable"
    resp = r.client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert a.bodies == []


def test_a_client_that_goes_away_closes_its_worker_stream(stub, live_router):
    a = stub("a")
    a.stream_forever = True
    r = live_router(replicas=[a.url])
    with r.client.stream("POST", "/v1/completions", json={"prompt": "p", "stream": True}) as s:
        lines = s.iter_lines()
        next(lines)
        assert r.router.pool.workers[0].outstanding == 1
    # the router closed its connection to the worker: the worker's stream ended
    r.wait_for(lambda: a.num_streams_closed == 1)
    r.wait_for(lambda: r.router.pool.workers[0].outstanding == 0)
