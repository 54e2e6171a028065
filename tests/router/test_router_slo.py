"""``router --goodput``: each completion / chat request judged as the router's client sees it
(``router.timing``), the SLO counters on /metrics, /stats with the workers' figures summed and
the router's own window, /stats/stream and /dashboard.

Delays are lower bounds on a loaded host, so a request made slower than a limit is missed for
certain; the met cases use limits no run reaches (60 s).
"""
from __future__ import annotations

import json
import re

import pytest

from sloserve.router.config import RouterConfig

from .stubs import sse_events

SLOW = {"ttft": 1000.0, "tpot": 100.0}
LOOSE = {"ttft": 60_000.0, "tpot": 60_000.0}


def _counters(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'(sloserve:requests_slo_(?:met|missed)_total)(\{reason="(\w+)"\})? (\S+)',
                     line)
        if m:
            out[m.group(1) + (f":{m.group(3)}" if m.group(3) else "")] = float(m.group(4))
    return out


def _stream(r, path="/v1/completions", **body):
    req = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
           else {"prompt": "p"})
    with r.client.stream("POST", path, json={**req, "stream": True, **body}) as resp:
        assert resp.status_code == 200
        return sse_events(resp.iter_lines())


def test_met_and_missed_by_the_first_limit_over(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=SLOW)
    a.first_delay = 1.1  # TTFT >= 1.1 s: missed on ttft, the first limit
    a.chunk_delay = 0.25
    _stream(r)
    a.first_delay = 0.0  # 3 chunks 250 ms apart: TPOT >= 250 ms
    _stream(r, "/v1/chat/completions")
    a.include_usage, a.usage_tokens = True, 5  # the usage event's count: TPOT = (E2E - TTFT) / 4
    a.chunk_delay = 0.3  # >= 600 ms / 4 = 150 ms: missed on tpot
    _stream(r)
    c = _counters(r.client.get("/metrics").text)
    assert c == {"sloserve:requests_slo_met_total": 0.0,
                 "sloserve:requests_slo_missed_total:ttft": 1.0,
                 "sloserve:requests_slo_missed_total:tpot": 2.0}
    s = r.client.get("/stats").json()
    assert s["seq"] == 3 and s["slo_ms"] == SLOW
    w = s["window"]
    assert (w["requests"], w["slo_met"], w["slo_missed"], w["attainment"]) == (3, 0, 3, 0.0)
    assert w["ttft_ms"]["p99"] > 1000 and w["tpot_ms"]["p99"] > 240  # (interpolated)
    assert 150 <= w["tpot_ms"]["p50"] < w["tpot_ms"]["p99"]
    assert w["itl_ms"]["p50"] >= 250  # ITLs of the n = 1 streams


def test_met_whole_answers_and_what_is_not_judged(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=LOOSE)
    _stream(r)
    assert r.client.post("/v1/completions", json={"prompt": "p"}).status_code == 200
    a.fail_status = 400  # an error answer: not judged
    assert r.client.post("/v1/completions", json={"prompt": "p", "stream": True}).status_code == 400
    a.fail_status = None
    a.stream_forever = True  # left by its client mid-stream: not judged
    with r.client.stream("POST", "/v1/completions", json={"prompt": "p", "stream": True}) as resp:
        lines = resp.iter_lines()
        next(lines)
    a.stream_forever = False
    # the agent APIs are passed through whole, not timed
    r.client.post("/v1/messages", json={"model": "m", "max_tokens": 3, "messages": []})
    r.wait_for(lambda: r.router.pool.workers[0].outstanding == 0)
    c = _counters(r.client.get("/metrics").text)
    assert c == {"sloserve:requests_slo_met_total": 2.0,
                 "sloserve:requests_slo_missed_total:ttft": 0.0,
                 "sloserve:requests_slo_missed_total:tpot": 0.0}
    w = r.client.get("/stats").json()["window"]
    assert (w["requests"], w["slo_met"], w["attainment"]) == (2, 2, 1.0)


def test_whole_answer_ttft_is_its_e2e(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=SLOW)
    a.delay = 1.1
    assert r.client.post("/v1/completions", json={"prompt": "p"}).status_code == 200
    c = _counters(r.client.get("/metrics").text)
    assert c["sloserve:requests_slo_missed_total:ttft"] == 1.0
    w = r.client.get("/stats").json()["window"]
    assert w["ttft_ms"]["p50"] == w["e2el_ms"]["p50"] >= 1100
    assert w["tpot_ms"] is None  # (the stub answers one token: no TPOT)


def test_no_goodput_no_judging_but_a_window(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url])
    _stream(r)
    s = r.client.get("/stats").json()
    assert s["slo_ms"] == {} and s["window"]["requests"] == 1
    assert "slo_met" not in s["window"]
    assert _counters(r.client.get("/metrics").text) == {"sloserve:requests_slo_met_total": 0.0}


def _worker_stats(running: int, kv: float, success: dict) -> dict:
    return {"object": "stats", "seq": 7, "model": "stub-model",
            "cumulative": {"vllm:num_requests_running": running,
                           "vllm:kv_cache_usage_perc": kv,
                           "sloserve:kv_cache_usage_peak_perc": kv * 2,
                           "vllm:request_success_total": success,
                           "sloserve:requests_slo_met_total": 1000,
                           "sloserve:stats_sequence": 7},
            "window": {"seconds": 60.0, "span_s": 1.0, "requests": running}}


def test_stats_sum_the_workers_under_the_routers_own(stub, live_router):
    a, b, c = stub("a"), stub("b"), stub("c")
    a.stats = _worker_stats(2, 0.5, {"length": 3, "stop": 1})
    b.stats = _worker_stats(5, 0.1, {"length": 4})
    r = live_router(replicas=[a.url, b.url, c.url], goodput=LOOSE)  # c: no /stats (404)
    _stream(r)
    s = r.client.get("/stats").json()
    cum = s["cumulative"]
    assert cum["vllm:num_requests_running"] == 7
    assert cum["vllm:kv_cache_usage_perc"] == pytest.approx(0.3)
    assert cum["sloserve:kv_cache_usage_peak_perc"] == 1.0
    assert cum["vllm:request_success_total"] == {"length": 7, "stop": 1}
    # the router's own keys win: its SLO count and sequence, not the workers'
    assert cum["sloserve:requests_slo_met_total"] == 1 and cum["sloserve:stats_sequence"] == 1
    assert s["model"] == "stub-model"
    assert [(x["url"], x["seq"], (x["window"] or {}).get("requests")) for x in s["workers"]] == [
        (a.url, 7, 2), (b.url, 7, 5), (c.url, None, None)]


def test_stats_equal_metrics_at_the_same_sequence(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=SLOW)
    for _ in range(2):
        _stream(r)
    text = r.client.get("/metrics").text
    s = r.client.get("/stats").json()
    seq = float(re.search(r"^sloserve:stats_sequence (\S+)", text, re.M).group(1))
    assert seq == s["seq"] == 2
    c = _counters(text)
    cum = s["cumulative"]
    assert cum["sloserve:requests_slo_met_total"] == c["sloserve:requests_slo_met_total"]
    for reason in ("ttft", "tpot"):
        assert (cum["sloserve:requests_slo_missed_total"][reason]
                == c[f"sloserve:requests_slo_missed_total:{reason}"])
    assert c["sloserve:requests_slo_met_total"] + sum(
        cum["sloserve:requests_slo_missed_total"].values()) == 2


def test_stats_stream_and_dashboard(stub, live_router):
    a = stub("a")
    r = live_router(replicas=[a.url])
    page = r.client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert b"stats/stream" in page.content and b"<script src" not in page.content
    with r.client.stream("GET", "/stats/stream?interval=0.1&steps=true") as resp:
        assert resp.status_code == 200
        events = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
    assert [e["object"] for e in events] == ["stats", "stats"]
    assert "workers" in events[0] and "steps" not in events[0]
    bad = r.client.get("/stats/stream?interval=0")
    assert bad.status_code == 400 and "interval" in bad.json()["error"]["message"]


def test_router_flag_parses_goodput():
    from sloserve.router.args import config_from_args, router_parser

    a = router_parser().parse_args(["--replicas", "http://h:1", "--goodput", "ttft:500",
                                    "tpot:40"])
    assert config_from_args(a).goodput == {"ttft": 500.0, "tpot": 40.0}
    with pytest.raises(ValueError, match="ttft, tpot or e2el"):
        config_from_args(router_parser().parse_args(["--replicas", "http://h:1",
                                                     "--goodput", "itl:5"]))
    assert RouterConfig(replicas=["http://h:1"]).goodput == {}


def test_a_client_that_leaves_right_after_done_is_still_counted(stub, live_router):
    """The verdict is taken as [DONE] passes through the router: a client that closes its
    connection at once (as a bench does) cannot cancel it (one of 60 went uncounted)."""
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=LOOSE)
    for _ in range(12):
        with r.client.stream("POST", "/v1/completions",
                             json={"prompt": "p", "stream": True}) as resp:
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    break
    r.wait_for(lambda: r.router.pool.workers[0].outstanding == 0)
    assert r.client.get("/stats").json()["seq"] == 12


def test_a_list_of_prompts_is_judged_per_choice(stub, live_router):
    """Four prompts stream four choices; the usage counts them all: TPOT is per choice (12
    tokens over 4 choices: 3 each, 2 gaps of 300 ms), so the request misses tpot:100."""
    a = stub("a")
    r = live_router(replicas=[a.url], goodput=SLOW)
    a.chunk_delay, a.include_usage, a.usage_tokens = 0.3, True, 12
    _stream(r, prompt=["a", "b", "c", "d"])
    c = _counters(r.client.get("/metrics").text)
    assert c["sloserve:requests_slo_missed_total:tpot"] == 1.0
    assert r.client.get("/stats").json()["window"]["tpot_ms"]["p50"] >= 300


def test_tool_call_and_reasoning_deltas_are_output():
    """A streamed chat answer of tool calls (or reasoning) alone has no content text: its
    chunks still time the request (they are what the client waits for)."""
    import json as _json

    from sloserve.router.timing import RequestTimer, num_prompts

    class Rec:
        got = []

        def record_request(self, *a):
            self.got.append(a)
    rec = Rec()
    t = RequestTimer(rec, chat=True, body={"stream": True})
    call = {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c1", "type": "function",
         "function": {"name": "f", "arguments": "{}"}}]}}]}
    think = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    t.feed(f"data: {_json.dumps(think)}\n\ndata: {_json.dumps(call)}\n\n", 1.0 + t.t0)
    t.feed("data: [DONE]\n\n", 2.0 + t.t0)
    t.finish()
    assert len(rec.got) == 1 and rec.got[0][0] == pytest.approx(1.0)
    assert (num_prompts("x"), num_prompts([1, 2, 3]), num_prompts(["a", "b"]),
            num_prompts([[1], [2], [3]])) == (1, 1, 2, 3)


def test_stats_keep_a_silent_workers_last_figures(stub, live_router):
    """A worker that stops answering /stats counts with its last answer (totals never fall);
    its own entry says it did not answer."""
    import time as _time

    from sloserve.router import app as router_app
    a, b = stub("a"), stub("b")
    a.stats = _worker_stats(2, 0.5, {"length": 3})
    b.stats = _worker_stats(5, 0.1, {"length": 4})
    r = live_router(replicas=[a.url, b.url])
    assert r.client.get("/stats").json()["cumulative"]["vllm:request_success_total"] == \
        {"length": 7}
    b.stats = None  # 404 from now on
    _time.sleep(router_app.STATS_TTL_S + 0.1)
    s = r.client.get("/stats").json()
    assert s["cumulative"]["vllm:request_success_total"] == {"length": 7}
    assert [x["seq"] for x in s["workers"]] == [7, None]


def test_disaggregated_requests_are_judged_across_both_halves(stub, live_router):
    """With --prefill / --decode the router's clock spans the prefill half too: a prefill
    server that takes 1.1 s makes the streamed request miss ttft:1000 (its decode server alone
    answers fast)."""
    p, d = stub("p"), stub("d")
    p.delay = 1.1  # the prefill half (not streamed) answers after 1.1 s
    r = live_router(prefill=[p.url], decode=[d.url], kv_transfer_flow="serial", goodput=SLOW)
    _stream(r)
    c = _counters(r.client.get("/metrics").text)
    assert c["sloserve:requests_slo_missed_total:ttft"] == 1.0
    assert r.client.get("/stats").json()["window"]["ttft_ms"]["p50"] >= 1100
