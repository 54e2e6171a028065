"""deploy/prometheus and deploy/grafana with a real Prometheus (Debian's ``prometheus``,
installed by ``make``): the rules pass ``promtool check`` and their ``promtool test rules``
cases; Prometheus scrapes a live ``serve --goodput`` server every second, its SLO counters
equal the requests' known verdicts, and every PromQL expression of the Grafana board evaluates
through Prometheus's HTTP API without error and non-empty."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    not (PROMTOOL and PROMETHEUS),
    reason="Prometheus is not installed (make installs Debian's prometheus package with "
           "apt-get as root; it could not here)")

#: TTFT always within 60 s, TPOT never within 0.001 ms: a 1-token request meets the SLO (it
#: has no TPOT), a longer one misses on tpot, whatever the host's speed
SLO = {"ttft": 60_000.0, "tpot": 0.001}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_promtool_checks_the_config_and_rules_and_runs_their_tests():
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "sloserve.rules.yml"],
                 ["test", "rules", "sloserve.rules.test.yml"]):
        p = subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        assert "SUCCESS" in p.stdout + p.stderr


def _board_exprs() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "sloserve.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p["targets"]]


@pytest.fixture(scope="module")
def server(helpers):
    srv = helpers.start_server(helpers.small_config, goodput=SLO)
    yield srv
    srv.stop()


@pytest.fixture
def prometheus(server, tmp_path):
    cfg = (DEPLOY / "prometheus" / "prometheus.yml").read_text().replace(
        '"127.0.0.1:8000"', f'"127.0.0.1:{server.port}"')
    (tmp_path / "prometheus.yml").write_text(cfg)
    shutil.copy(DEPLOY / "prometheus" / "sloserve.rules.yml", tmp_path)
    port = _free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if api.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "Prometheus did not get ready in 60 s"
            time.sleep(0.2)
        yield api
    finally:
        api.close()
        proc.terminate()
        proc.wait(timeout=30)


def _query(api: httpx.Client, expr: str) -> list[dict]:
    r = api.get("/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _wait(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.25)
    return got


def test_prometheus_scrapes_the_slo_counters_and_the_board_evaluates(server, prometheus):
    up = f'up{{job="sloserve",instance="127.0.0.1:{server.port}"}} == 1'
    _wait(lambda: _query(prometheus, up), "the server scraped")
    met = 'sloserve:requests_slo_met_total'
    base = _wait(lambda: _query(prometheus, met), "the SLO counter scraped")
    base_met = float(base[0]["value"][1])
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        body = {"model": server.model, "prompt": "The capital of France is", "ignore_eos": True}
        for i in range(8):  # over a few seconds, so rates over the 1 m window see them
            r = c.post("/v1/completions", json={**body, "max_tokens": 1 if i % 2 else 4})
            assert r.status_code == 200
            time.sleep(0.3)
        seq = c.get("/stats").json()["seq"]
    # scraped once the server's records are all in (its sequence number in the scrape)
    _wait(lambda: [r for r in _query(prometheus, "sloserve:stats_sequence")
                   if float(r["value"][1]) >= seq], "the last records scraped")
    got = float(_query(prometheus, met)[0]["value"][1]) - base_met
    missed = _query(prometheus, 'sloserve:requests_slo_missed_total{reason="tpot"}')
    assert got == 4 and float(missed[0]["value"][1]) >= 4
    inc = _query(prometheus, f"increase({met}[5m])")
    assert abs(float(inc[0]["value"][1]) - 4 - base_met) <= 2  # increase() extrapolates
    # the recording rules have evaluated, and every expression of the board answers
    _wait(lambda: _query(prometheus, "sloserve:slo_attainment:ratio_rate1m"), "the rules")
    for expr in _board_exprs():
        assert _wait(lambda: _query(prometheus, expr), f"{expr!r} non-empty", 20.0)
