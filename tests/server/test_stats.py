"""``serve --goodput``'s SLO counters and ``GET /stats`` / ``/stats/stream`` on a live server:
requests judged exactly as ``sloserve bench`` judges them (one rule, ``sloserve.slo``), a
snapshot equal to the scrape at its sequence number, the stream's snapshots moving on."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families


#: every TTFT meets 60 s; every TPOT misses 0.001 ms, so a request meets the SLO only when it
#: has one output token (no TPOT): the verdicts are known without any timing
SLO = {"ttft": 60_000.0, "tpot": 0.001}


@pytest.fixture(scope="module")
def server(helpers):
    srv = helpers.start_server(helpers.small_config, goodput=SLO)
    yield srv
    srv.stop()


def _scrape(c: httpx.Client) -> dict:
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_slo_counters_and_the_snapshot_agree_with_the_scrape(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        body = {"model": server.model, "prompt": "The capital of France is", "temperature": 0}
        for n in (1, 1, 1, 6, 6):
            r = c.post("/v1/completions", json={**body, "max_tokens": n, "ignore_eos": True})
            assert r.status_code == 200
        scraped, snap = _scrape(c), c.get("/stats").json()
        assert scraped[("sloserve:requests_slo_met_total", ())] == 3
        assert scraped[("sloserve:requests_slo_missed_total", (("reason", "tpot"),))] == 2
        assert scraped[("sloserve:requests_slo_missed_total", (("reason", "ttft"),))] == 0
        # idle: the scrape and the snapshot are at one sequence, with the same counters
        assert snap["seq"] == scraped[("sloserve:stats_sequence", ())]
        cum = snap["cumulative"]
        assert cum["sloserve:requests_slo_met_total"] == 3
        assert cum["sloserve:requests_slo_missed_total"] == {"ttft": 0.0, "tpot": 2.0}
        assert cum["vllm:generation_tokens_total"] == \
            scraped[("vllm:generation_tokens_total", ())] == 15
        assert cum["vllm:request_success_total"]["length"] == 5
        w = snap["window"]
        assert (w["requests"], w["slo_met"], w["slo_missed"]) == (5, 3, 2)
        assert w["attainment"] == pytest.approx(0.6)
        assert w["ttft_ms"]["p50"] > 0 and w["tpot_ms"]["p99"] >= w["tpot_ms"]["p50"] > 0
        assert snap["slo_ms"] == SLO

        # the stream: one snapshot per interval, the sequence moving with the engine's records
        seqs = []
        with c.stream("GET", "/stats/stream", params={"interval": 0.2}) as s:
            for line in s.iter_lines():
                if not line.startswith("data: "):
                    continue
                seqs.append(json.loads(line[6:])["seq"])
                if len(seqs) == 1:
                    c.post("/v1/completions", json={**body, "max_tokens": 2})
                if len(seqs) == 4:
                    break
        assert seqs[0] == snap["seq"] and seqs[-1] > seqs[0]

        # the steps kept for the dashboard: 8 fields, the roofline bound None without one
        steps = c.get("/stats", params={"steps": "true"}).json()
        assert steps["steps"] and all(len(x) == 8 for x in steps["steps"])
        shape = server.engine.info.model_shape
        assert (shape["num_hidden_layers"], shape["hidden_size"], shape["vocab_size"]) == \
            (30, 576, 49152)
        assert shape["weight_bytes"] > 0
        assert c.get("/stats/stream", params={"interval": 0}).status_code == 400

