"""The overload soak (``benchmarks/soak.py``), bounded for CI: a real ``sloserve serve`` process
(the tiny random Llama, one torch thread, 4 seats, 4 waiting at most) offered 1.5x its measured
capacity for 200 requests (plus 60 to measure it and 40 to warm up). The server must answer
200 or 429 only, /health 200 every time it is polled (in every phase of the soak), keep both
processes' RSS within 5 % of their size after the warm-up, and hold no KV block once the soak
drained. No wall-time bound here (a loaded CI host can be 10x slower): /health's latency limit
and the drain's wait are hang guards in this run; the soak's own defaults (1 s, 10 s) are for runs
by hand. Also: the soak's checks fail on a 5xx, a slow or failed /health, RSS growth and a leaked
block, and the soak imports no sloserve code."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOAK = os.path.join(ROOT, "benchmarks", "soak.py")
N_SOAK, N_CAPACITY, N_WARMUP = 200, 60, 40


def _load_soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory, helpers):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("soak") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sloserve.cli", "serve", tiny_llama_dir, "--dtype", "float32",
         "--num-threads", "1", "--max-num-seqs", "4", "--max-waiting-requests", "4",
         "--max-model-len", "512", "--num-kv-blocks", "256", "--port", str(port),
         "--log-level", "warning"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        helpers.wait_healthy(proc, base, log_path)
        yield proc, base, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_overload_soak_holds(served, tmp_path):
    proc, base, log_path = served
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, SOAK, "--url", base, "--server-pid", str(proc.pid),
                        "--num-requests", str(N_SOAK), "--capacity-requests", str(N_CAPACITY),
                        "--warmup-requests", str(N_WARMUP), "--json", str(out),
                        # hang guards, not speed bounds: /health must answer (200) every time,
                        # but may be slow on a loaded host, as may the drains
                        "--health-limit-s", "60", "--health-timeout", "60",
                        "--drain-timeout", "120"],
                       # a hang guard: the soak takes ~5 s on a quiet host (~10 s with its
                       # start), so 10x that on a loaded one is still far inside it
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr + log_path.read_text()[-3000:]
    rep = json.loads(out.read_text())
    assert rep["checks"] == dict.fromkeys(rep["checks"])  # every check passed
    c = rep["status_counts"]
    assert rep["requests_sent"] == N_SOAK == c["200"] + c["429"]
    assert c["5xx"] == c["other"] == 0 and c["200"] > 0
    assert sum(rep["status_counts_all_phases"].values()) == N_CAPACITY + N_WARMUP + N_SOAK
    assert rep["offered_rate_req_s"] == pytest.approx(1.5 * rep["capacity_req_s"])
    assert rep["ttft_p99_s"] is not None and rep["ttft_p99_s"] <= rep["ttft_max_s"]
    assert not rep["health_failures"]  # every poll answered 200
    # it polled all along: answers in each phase that runs requests (the soak holds such a phase
    # open until one came, so a quiet host and a loaded one both have >= 1; 0 means the poller
    # died or never ran); the drains may be too short for one
    by_phase = rep["health_polls_by_phase"]
    assert all(by_phase[k] >= 1 for k in ("capacity", "warmup", "soak")), by_phase
    assert sum(by_phase.values()) <= rep["health_polls"], by_phase
    for k in ("server", "core"):
        assert rep["rss_growth"][k] < 0.05
    rows = rep["rss_samples"]["rows"]  # sampled along the way (every 5 s)
    assert rows and all(len(r) == 3 and r[1] > 0 and r[2] > 0 for r in rows)
    with open(f"/proc/{rep['pids']['core']}/cmdline", "rb") as f:  # the core was measured
        assert b"sloserve.engine.core_proc" in f.read()
    g = rep["after_drain_gauges"]
    assert (g["vllm:num_requests_running"], g["vllm:num_requests_waiting"],
            g["vllm:kv_cache_usage_perc"]) == (0, 0, 0)


def test_soak_checks_fail_on_each_defect():
    soak = _load_soak()
    args = soak.parse_args(["--server-pid", "1", "--num-requests", "1"])
    # the defaults for runs by hand (the test above passes hang guards instead)
    assert (args.health_limit_s, args.health_timeout, args.drain_timeout) == (1.0, 5.0, 10.0)
    ok = soak.Result("soak", "chat", 10, 8, status=200, ttft_s=0.1)

    def report(**kw):
        rep = {"health_max_s": 0.05, "health_failures": [], "rss_growth": {"server": 0.01,
                                                                           "core": 0.0},
               "rss_kb_start": {"server": 1000, "core": 2000},
               "rss_kb_end": {"server": 1010, "core": 2000}, "drain_s": 0.1,
               "after_drain_gauges": {"vllm:num_requests_running": 0.0,
                                      "vllm:num_requests_waiting": 0.0,
                                      "vllm:kv_cache_usage_perc": 0.0}}
        rep.update(kw)
        return rep

    assert not any(soak.checks(report(), args, [ok]).values())
    def failed(rep, results=(ok,)) -> set[str]:
        return {k for k, v in soak.checks(rep, args, list(results)).items() if v}

    assert failed(report(), [ok, soak.Result("soak", "chat", 10, 8, status=503)]) == {
        "no_5xx", "no_unexpected_answers"}
    assert failed(report(), [soak.Result("soak", "chat", 10, 8, status=0, error="reset")]) == {
        "no_unexpected_answers"}
    assert failed(report(), [soak.Result("soak", "chat", 10, 8, status=200, error="{}")]) == {
        "no_unexpected_answers"}  # an error event inside a 200 stream
    assert failed(report(), [soak.Result("soak", "chat", 10, 8, status=429)]) == set()
    assert failed(report(health_max_s=1.0)) == {"health_under_limit"}
    assert failed(report(health_failures=["/health answered 503"])) == {"health_under_limit"}
    assert failed(report(rss_growth={"server": 0.0, "core": 0.05})) == {"rss_growth_under_limit"}
    assert failed(report(after_drain_gauges={"vllm:num_requests_running": 0.0,
                                             "vllm:num_requests_waiting": 0.0,
                                             "vllm:kv_cache_usage_perc": 0.0078})) == {
        "no_leaked_block"}
    assert soak.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert soak.percentile([5.0], 99) == 5.0 and soak.percentile([], 99) is None
    text = ('vllm:num_requests_running{model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{model_name="m"} 0.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert soak.gauges(text) == {"vllm:num_requests_running": 2.0,
                                 "vllm:num_requests_waiting": 0.0,
                                 "vllm:kv_cache_usage_perc": 0.25}


def test_the_soak_talks_http_only():
    """benchmarks/soak.py imports no engine, model or server code (nor torch)."""
    tree = ast.parse(open(SOAK, encoding="utf-8").read())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "httpx" in mods
    assert not {m for m in mods if m.split(".")[0] in ("sloserve", "torch", "transformers")}
