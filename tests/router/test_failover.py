"""A worker that dies: its requests in flight fail within 2 s (an error event then [DONE] in a
stream under way, a 502 otherwise), new requests avoid it, it rejoins once healthy again."""
from __future__ import annotations

import json
import threading
import time

from .stubs import served_by

#: the issue's bound: from a worker's death to its clients' errors
FAIL_WITHIN_S = 2.0


def _read_until_error(resp, started: threading.Event, out: dict) -> None:
    """Read SSE lines; note when the first chunk came and when the error event came."""
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            out["done_at"] = time.monotonic()
            break
        ev = json.loads(data)
        if "error" in ev:
            out["error_at"] = time.monotonic()
            out["error"] = ev["error"]
        else:
            started.set()


def _stream_then(router, action, path="/v1/completions"):
    """Start a stream, wait for its first chunk, run ``action`` (returns the moment of the
    death), read the rest; returns (seconds from death to the error event, what was read)."""
    out: dict = {}
    started = threading.Event()
    with router.client.stream("POST", path, json={"prompt": "p", "stream": True},
                              timeout=30) as resp:
        assert resp.status_code == 200
        reader = threading.Thread(target=_read_until_error, args=(resp, started, out))
        reader.start()
        assert started.wait(10)
        died_at = action()
        reader.join(30)
    assert "error_at" in out, out
    assert "done_at" in out  # the stream still ends with [DONE]
    return out["error_at"] - died_at, out


def test_killed_worker_fails_its_stream_at_once_and_rejoins(stub, live_router):
    a, b = stub("a"), stub("b")
    a.stream_forever = b.stream_forever = True
    r = live_router(replicas=[a.url, b.url], routing_policy="round-robin")

    def kill_a():
        t = time.monotonic()
        a.kill()
        return t

    waited, out = _stream_then(r, kill_a)  # round-robin: the first request is a's
    assert waited < FAIL_WITHIN_S
    assert out["error"]["code"] == 502 and a.url in out["error"]["message"]
    r.wait_for(lambda: r.states()[a.url] == "down")
    b.stream_forever = False
    assert [served_by(r.client.post("/v1/completions", json={"prompt": "q"}))
            for _ in range(3)] == ["b", "b", "b"]
    assert r.client.get("/health").status_code == 200  # b is enough
    a.stream_forever = False
    a.restart()
    r.wait_for(lambda: r.states()[a.url] == "healthy")
    got = {served_by(r.client.post("/v1/completions", json={"prompt": "q"})) for _ in range(4)}
    assert got == {"a", "b"}
    metrics = r.client.get("/metrics").text
    assert f'sloserve_router_proxy_errors_total{{reason="reset",worker="{a.url}"}}' in metrics \
        or f'sloserve_router_proxy_errors_total{{reason="worker_down",worker="{a.url}"}}' in metrics


def test_hung_worker_is_marked_down_by_its_health_poll(stub, live_router):
    """A frozen worker (a stopped process: connections open, nothing answers) is found by the
    health poll (interval 0.5 s + timeout 0.5 s here): its stream, and a whole-response request,
    fail within 2 s."""
    a, b = stub("a"), stub("b")
    a.stream_forever = True
    r = live_router(replicas=[a.url, b.url], routing_policy="round-robin",
                    health_check_timeout=0.5)

    def freeze_a():
        t = time.monotonic()
        a.freeze()
        return t

    waited, out = _stream_then(r, freeze_a)
    assert waited < FAIL_WITHIN_S
    assert "went down" in out["error"]["message"]
    assert r.states()[a.url] == "down"
    assert served_by(r.client.post("/v1/completions", json={"prompt": "q"})) == "b"
    # a whole (non-streamed) request in flight when its worker hangs gets a 502
    a.frozen = False
    r.wait_for(lambda: r.states()[a.url] == "healthy")
    r.router.policy._turns._next = 0  # a's turn
    a.delay = 5.0
    t0 = time.monotonic()
    timer = threading.Timer(0.2, a.freeze)
    timer.start()
    resp = r.client.post("/v1/completions", json={"prompt": "q"}, timeout=30)
    assert resp.status_code == 502, resp.text
    assert time.monotonic() - t0 < 0.2 + FAIL_WITHIN_S
    assert resp.json()["error"]["type"] == "BadGatewayError"


def test_unreachable_worker_is_skipped_before_its_poll_notices(stub, live_router):
    """A worker that died between polls: the request that finds its port closed is sent to
    another worker, and the dead one is marked down at once."""
    a, b = stub("a"), stub("b")
    r = live_router(replicas=[a.url, b.url], routing_policy="round-robin",
                    health_check_interval=30)
    a.kill()
    assert r.states()[a.url] == "healthy"  # not polled since
    resp = r.client.post("/v1/completions", json={"prompt": "q"})
    assert resp.status_code == 200 and served_by(resp) == "b"
    assert r.states()[a.url] == "down"
