"""Disaggregated serving through the router: the exact bodies each half gets in both flows,
the client's one answer, and a failed prefill half aborting the decode half."""
from __future__ import annotations

import json
import time

from .stubs import sse_events

BODY = {"model": "stub", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "stream": True, "stream_options": {"include_usage": True}}


def _kv(role: str, port: int, mode: str) -> dict:
    return {"kv_role": role, "engine_id": f"{role}-engine", "kv_host": "0.0.0.0",
            "kv_port": port, "mode": mode}


def test_serial_flow_sends_prefill_then_decode(stub, live_router):
    p, d = stub("p"), stub("d")
    r = live_router(prefill=[p.url], decode=[d.url], kv_transfer_flow="serial")
    resp = r.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.json()["worker"] == "d"
    ((ppath, pbody),) = p.bodies
    assert ppath == "/v1/completions"
    assert pbody == {**BODY, "max_tokens": 1, "stream": False, "n": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}
    ((_, dbody),) = d.bodies
    assert dbody == {**BODY, "kv_transfer_params": {
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "127.0.0.1",
        "remote_port": 7777, "transfer_id": "t-p", "remote_block_ids": [3, 4]}}

    # a streamed chat: the prefill half is not streamed and has no stream_options
    with r.client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]] == \
        ["d-0", "d-1", "d-2"]
    pbody = p.bodies[-1][1]
    assert pbody == {**{k: v for k, v in CHAT.items() if k != "stream_options"},
                     "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}
    assert d.bodies[-1][1]["stream"] is True
    assert d.bodies[-1][1]["stream_options"] == {"include_usage": True}


def test_serial_flow_returns_the_prefill_answer_when_it_is_whole(stub, live_router):
    p, d = stub("p"), stub("d")
    p.finish_reason = "stop"  # the first token was the last
    r = live_router(prefill=[p.url], decode=[d.url], kv_transfer_flow="serial")
    resp = r.client.post("/v1/completions", json=BODY)
    assert resp.json()["worker"] == "p" and resp.json()["choices"][0]["text"] == "p"
    with r.client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        events = [json.loads(e) for e in sse_events(resp.iter_lines())[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": "p"}
    assert events[0]["choices"][0]["finish_reason"] == "stop"
    assert events[1]["usage"]["total_tokens"] == 4 and events[1]["choices"] == []
    p.finish_reason = "length"
    resp = r.client.post("/v1/completions", json={**BODY, "max_tokens": 1})
    assert resp.json()["worker"] == "p"
    assert d.bodies == []


def test_concurrent_flow_pull_and_push(stub, live_router):
    p, d = stub("p", _kv("kv_producer", 6001, "pull")), stub("d", _kv("kv_consumer", 6002, "pull"))
    r = live_router(prefill=[p.url], decode=[d.url])  # concurrent is the default
    assert r.states() == {p.url: "healthy", d.url: "healthy"}
    resp = r.client.post("/v1/completions", json=BODY)
    assert resp.status_code == 200 and resp.json()["worker"] == "d"
    pkv = p.bodies[-1][1].pop("kv_transfer_params")
    dkv = d.bodies[-1][1].pop("kv_transfer_params")
    tid = pkv["transfer_id"]
    assert len(tid) == 32 and int(tid, 16) >= 0
    assert pkv == {"do_remote_decode": True, "transfer_id": tid}
    assert dkv == {"do_remote_prefill": True, "transfer_id": tid,
                   "remote_host": "127.0.0.1", "remote_port": 6001}
    assert p.bodies[-1][1] == {**BODY, "max_tokens": 1, "stream": False, "n": 1}
    assert d.bodies[-1][1] == BODY

    p.kv_info, d.kv_info = _kv("kv_producer", 6001, "push"), _kv("kv_consumer", 6002, "push")
    r.router.pool.workers[0].kv_info = r.router.pool.workers[1].kv_info = None  # re-read
    with r.client.stream("POST", "/v1/chat/completions", json=CHAT) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and len(events) == 4
    pkv = p.bodies[-1][1]["kv_transfer_params"]
    dkv = d.bodies[-1][1]["kv_transfer_params"]
    assert pkv == {"do_remote_decode": True, "transfer_id": dkv["transfer_id"],
                   "remote_host": "127.0.0.1", "remote_port": 6002}
    assert dkv == {"do_remote_prefill": True, "transfer_id": pkv["transfer_id"]}
    assert pkv["transfer_id"] != tid


def test_concurrent_flow_prefill_failure_aborts_the_decode_half(stub, live_router):
    p, d = stub("p", _kv("kv_producer", 6001, "pull")), stub("d", _kv("kv_consumer", 6002, "pull"))
    p.fail_status, p.delay = 400, 0.3  # fails once the decode half has begun
    d.stream_forever = True
    d.delay = 30.0
    r = live_router(prefill=[p.url], decode=[d.url])
    resp = r.client.post("/v1/completions", json=BODY, timeout=20)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "p refuses"
    # streamed: the decode half's stream had begun; it ends with the prefill error event
    with r.client.stream("POST", "/v1/completions", json={**BODY, "stream": True},
                         timeout=20) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert json.loads(events[-2])["error"]["message"] == "p refuses"
    assert events[-1] == "[DONE]"
    # the decode server saw both requests go away
    r.wait_for(lambda: r.router.pool.workers[1].outstanding == 0)
    deadline = time.monotonic() + 5
    while d.num_streams_closed < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.num_streams_closed == 1
    assert "prefill_failed" in r.client.get("/metrics").text


def test_health_needs_both_roles(stub, live_router):
    p, d = stub("p"), stub("d")
    d.health_status = 503
    r = live_router(prefill=[p.url], decode=[d.url], kv_transfer_flow="serial")
    h = r.client.get("/health")
    assert h.status_code == 503
    assert {w["role"]: w["state"] for w in h.json()["workers"]} == {"prefill": "healthy",
                                                                    "decode": "unhealthy"}
    assert r.client.post("/v1/completions", json=BODY).status_code == 503
    assert p.bodies == []  # no prefill while no decode server could take the request
