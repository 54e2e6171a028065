"""Isolation and determinism: /health tells a stopped engine core from a running one without
failing what it holds, and --max-waiting-requests holds for any burst and for n > 1.

No assertion bounds wall time: the states are polled, under 60 s hang guards."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from sloserve.config import EngineConfig

LIMIT = 8  # --max-waiting-requests
# one server for both tests: a 1 s stall timeout is small, but safe: test A only asks for 503
# while the core is stopped, and for 200 at some point after it resumed (a long step on a loaded
# host may flip it back a while); test B never asks /health. One seat, so test B's queue cannot
# move while its long request runs.
CFG = EngineConfig(model=None, dtype="float32", num_kv_blocks=256, max_model_len=2048,
                   engine_stall_timeout=1.0, max_num_seqs=1, max_waiting_requests=LIMIT)


@pytest.fixture(scope="module")
def srv(helpers):
    s = helpers.start_server(CFG)
    yield s
    s.stop()


def _wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed bound
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _data(lines) -> list[str]:
    return [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]


# ------------------------------------------------------------------ A. /health and a stall
def test_health_is_503_while_the_core_is_stopped_and_200_after_nothing_lost(srv):
    engine = srv.engine
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        # an idle core sends nothing, and is not stalled: no work is pending
        _wait_for(lambda: time.monotonic() - engine._heard_at > 1.5, "idle for 1.5 s")
        assert c.get("/health").status_code == 200

        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 300, "temperature": 0,
                    "ignore_eos": True, "stream": True, "logprobs": 0,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body,
                              timeout=120) as r:
                assert r.status_code == 200
                for ln in r.iter_lines():
                    lines.append(ln)
                    if ln.startswith("data: "):
                        first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(60), "no token came"
        pid = engine.client.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_for(lambda: c.get("/health").status_code == 503, "/health never said 503")
            h = c.get("/health")
            err = h.json()["error"]
            assert h.status_code == 503 and err["code"] == 503
            assert err["type"] == "ServiceUnavailableError"
            assert "no step" in err["message"] and "--engine-stall-timeout" in err["message"]
            assert engine.is_running  # stalled, not declared dead: nothing was failed
            assert engine.num_unfinished == 1 and t.is_alive()
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait_for(lambda: c.get("/health").status_code == 200, "/health never said 200")
        t.join(600)  # a hang guard
        assert not t.is_alive()
        events = _data(lines)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in ch for ch in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]
                if ch["choices"]][-1] == "length"
        # every token reached the client: 300 tokens streamed, none twice (their offsets)
        lps = [ch["choices"][0]["logprobs"] for ch in chunks[:-1] if ch["choices"]]
        assert sum(len(lp["tokens"]) for lp in lps) == 300
        text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1] if ch["choices"])
        offsets = [o for lp in lps for o in lp["text_offset"]]
        assert offsets == sorted(offsets) and offsets[-1] < len(text)


# ------------------------------------------------------------------ B. admission under a burst
_WAITING = re.compile(r'^vllm:num_requests_waiting\{[^}]*\} (\S+)$', re.M)


def test_max_waiting_requests_holds_for_a_burst_and_for_n_choices(srv):
    limit = LIMIT
    engine, base = srv.engine, srv.base_url
    seen = {"stats": 0, "metrics": 0}
    stop = threading.Event()

    def poll() -> None:  # the waiting gauge, sampled throughout, both as read and as served
        with httpx.Client(base_url=base, timeout=60) as c:
            while not stop.is_set():
                seen["stats"] = max(seen["stats"], engine.stats.num_waiting)
                m = _WAITING.search(c.get("/metrics").text)
                seen["metrics"] = max(seen["metrics"], int(float(m.group(1))))

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
            def req(n: int = 1, max_tokens: int = 2):
                return c.build_request("POST", "/v1/completions", json={
                    "prompt": "Hello there", "max_tokens": max_tokens, "n": n,
                    "temperature": 0, "ignore_eos": True, "stream": True})

            # the one running request: the queue cannot move until it is cut below
            long = await c.send(req(max_tokens=1900), stream=True)
            assert long.status_code == 200
            _wait_for(lambda: engine.stats.num_running == 1, "the long request never ran")

            # 20 at once: a streamed answer's status comes at admission, so every status is
            # known while the long request still holds the only seat
            burst = await asyncio.gather(*(c.send(req(), stream=True) for _ in range(20)))
            admitted = [r for r in burst if r.status_code == 200]
            refused = [r for r in burst if r.status_code != 200]
            _wait_for(lambda: engine.stats.num_waiting == len(admitted), "admitted not queued")
            assert engine.stats.num_running == 1 and engine.num_unfinished == 1 + len(admitted)
            assert len(admitted) == limit, [r.status_code for r in burst]
            for r in refused:
                await r.aread()
                err = r.json()["error"]
                assert r.status_code == 429 and err["code"] == 429
                assert err["type"] == "RateLimitError" and "limit is 8" in err["message"]
                assert int(r.headers["Retry-After"]) >= 1

            # two of the queued ones leave (their clients disconnect): their places free up
            for r in admitted[:2]:
                await r.aclose()
            _wait_for(lambda: engine.stats.num_waiting == limit - 2, "the two were not aborted")
            # n=3 with 2 places left: a 429, and nothing reserved
            r3 = await c.send(req(n=3), stream=True)
            await r3.aread()
            assert r3.status_code == 429, r3.text
            assert "6 requests are waiting and this one needs 3 places" in r3.json()["error"][
                "message"]
            assert engine._reserved == [] and len(engine._in_transit) == 0
            # n=2 fits exactly; then not even one more
            r2 = await c.send(req(n=2), stream=True)
            assert r2.status_code == 200
            _wait_for(lambda: engine.stats.num_waiting == limit, "the two choices not queued")
            one = await c.send(req(), stream=True)
            await one.aread()
            assert one.status_code == 429
            assert engine.stats.num_running == 1  # the long request held the seat throughout

            # cut the long one: the queue drains, every admitted request completes
            await long.aclose()
            for r in [*admitted[2:], r2]:
                events = _data([ln async for ln in r.aiter_lines()])
                await r.aclose()
                assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
            _wait_for(lambda: engine.num_unfinished == 0, "the queue never drained")
            assert engine._reserved == [] and engine.stats.num_waiting == 0

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        t.join(60)
    assert seen["stats"] <= limit and seen["metrics"] <= limit, seen
