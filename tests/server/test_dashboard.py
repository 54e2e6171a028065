"""``GET /dashboard`` in headless Chromium (Debian's, driven by Playwright; no browser download,
no network) while requests run: the page draws live snapshots of ``/stats/stream``."""
from __future__ import annotations

import httpx
import pytest

from tests.browser import chromium as browser_chromium


@pytest.fixture(scope="module")
def server(helpers):
    srv = helpers.start_server(helpers.small_config, goodput={"ttft": 200.0, "tpot": 50.0})
    yield srv
    srv.stop()


def _stream_ttft(c: httpx.Client, body: dict) -> float:
    """One streamed completion; its TTFT as the client saw it (s)."""
    import time
    t0 = time.perf_counter()
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    return first


def test_the_dashboard_shows_the_snapshots_live(server):
    """Headless Chromium on /dashboard while requests run: its figures move between two reads;
    once the server is idle they equal /stats at the same sequence number, and its window
    holds exactly the requests sent, its P50 TTFT shown as the snapshot has it. (How close
    that P50 is to a client's own is a measurement, not a test: benchmarks/dashboard_check.py.)"""
    import threading
    sync_playwright, chromium = browser_chromium()
    body = {"model": server.model, "prompt": "Tell me about the sea. " * 30, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    ttfts: list[float] = []

    def load():
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            for _ in range(10):
                ttfts.append(_stream_ttft(c, body))
    # a step roofline on made-up hardware figures far below any machine's (the machine's own
    # cache may be absent): the steps raise both roofs to the rates they reach
    from sloserve.roofline.hardware import Hardware
    from sloserve.roofline.step import served_roofline
    info, metrics = server.engine.info, server.engine.stat_loggers[0]
    metrics.roofline = served_roofline(info.model_shape, info.dtype, info.kv_cache_dtype,
                                       hw=Hardware("test", {"fp32": 1e9}, 1e8, 0))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.base_url + "/dashboard")
            page.wait_for_function("window.__updates >= 1", timeout=30_000)
            first = page.evaluate("window.__stats")
            shown_first = page.inner_text('[data-key="cumulative.vllm:request_success_total"]')
            worker = threading.Thread(target=load)
            worker.start()
            worker.join(timeout=300)
            assert not worker.is_alive() and len(ttfts) == 10
            with httpx.Client(base_url=server.base_url, timeout=30) as c:
                stats = c.get("/stats").json()
            page.wait_for_function(f"window.__stats && window.__stats.seq == {stats['seq']}",
                                   timeout=30_000)
            seen = page.evaluate("window.__stats")
            text = {el.get_attribute("data-key"): el.inner_text()
                    for el in page.query_selector_all(".value[data-key]")}
            drawn = page.evaluate("document.getElementById('ch-steps').dataset.points")
            bounded = page.evaluate("document.getElementById('ch-steps').dataset.bounded")
            bound_line = page.query_selector("#bound-line") is not None
            legend = page.inner_text("#lg-steps")
            seq_shown = page.inner_text("#seq")
        finally:
            browser.close()
    assert seen["seq"] > first["seq"]
    assert seen["cumulative"] == stats["cumulative"]  # the same values at the same sequence
    finished = sum(stats["cumulative"]["vllm:request_success_total"].values())
    assert text["cumulative.vllm:request_success_total"] == str(int(finished))
    assert int(shown_first) < finished  # the figure moved between the two reads
    assert seq_shown == str(stats["seq"]) and int(drawn) > 0
    # each step's roofline bound beside its time
    assert int(bounded) > 0 and bound_line
    assert "TFLOP/s reached, measured 0.00, " in legend
    assert "GB/s reached, measured 0.1, " in legend
    roof = seen["roofline"]
    assert (roof["measured_peak_tflops"], roof["measured_bandwidth_gbs"]) == (0.001, 0.1)
    assert roof["peak_tflops"] > 0.001 and roof["bandwidth_gbs"] > 0.1
    # no step is faster than its bound
    assert all(s[7] <= s[4] * (1 + 1e-9) for s in seen.get("steps") or [] if s[7])
    # the window holds exactly the ten requests of this server
    page_p50 = seen["window"]["ttft_ms"]["p50"]
    assert seen["window"]["requests"] == 10
    assert text["window.ttft_ms.p50"] == f"{page_p50:.1f}" or page_p50 >= 1000
    assert all(t is not None and t > 0 for t in ttfts)
