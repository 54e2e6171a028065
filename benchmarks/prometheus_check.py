"""deploy/prometheus and deploy/grafana against a live server under load (issue 38's check,
recorded): start Prometheus (Debian's) with the shipped config and rules, scraping ``--target``
every second; run ``sloserve bench`` (everything after ``--``); then compare ``increase()`` of
``sloserve:requests_slo_met_total`` over the run with the bench's count of requests within its
``--goodput`` SLO, and evaluate every PromQL expression of deploy/grafana/sloserve.json through
Prometheus's HTTP API (errors and empty answers listed).

    sloserve serve --goodput ttft:1000 tpot:50 --port 8000 &
    .venv/bin/python benchmarks/prometheus_check.py --target 127.0.0.1:8000 --out FILE.json -- \\
        --dataset-name mixed --mixed-scale 0.25 --num-prompts 60 --request-rate 0.8 \\
        --ignore-eos --goodput ttft:1000 tpot:50

Against a server without sloserve's counters (vLLM), ``--board-only`` runs the bench and
evaluates the board alone.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from prometheus_local import DEPLOY, LocalPrometheus


def query(api: httpx.Client, expr: str, at: float | None = None) -> dict:
    params = {"query": expr, **({"time": f"{at:.3f}"} if at else {})}
    return api.get("/api/v1/query", params=params).json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="host:port of the server's /metrics")
    ap.add_argument("--out", required=True)
    ap.add_argument("--board-only", action="store_true")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    prom = LocalPrometheus(a.target)
    api = prom.api
    work = tempfile.mkdtemp(prefix="prom-check-")
    try:
        time.sleep(3)  # a few scrapes before the load
        host, tport = a.target.rsplit(":", 1)
        t0 = time.time()
        sloserve = os.path.join(os.path.dirname(sys.executable), "sloserve")
        subprocess.run([sloserve, "bench", "--host", host, "--port", tport, "--save-result",
                        "--result-dir", work, "--result-filename", "bench.json",
                        "--disable-tqdm", *bench_args], check=True)
        time.sleep(4)  # the last finishes scraped (1 s interval) and rules evaluated
        t1 = time.time()
        with open(os.path.join(work, "bench.json")) as f:
            bench = json.load(f)
        result: dict = {"target": a.target, "bench_args": bench_args,
                        "bench_completed": bench["completed"], "bench_duration_s": bench["duration"]}
        if not a.board_only:
            good = round((bench.get("request_goodput") or 0.0) * bench["duration"])
            window = int(t1 - t0) + 2
            inc = query(api, f"sum(increase(sloserve:requests_slo_met_total[{window}s]))", t1)
            missed = query(api, "sum by (reason) (increase(sloserve:requests_slo_missed_total"
                                f"[{window}s]))", t1)
            met = float(inc["data"]["result"][0]["value"][1]) if inc["data"]["result"] else None
            result.update(bench_slo_met=good, prometheus_increase_met=met,
                          difference=None if met is None else met - good,
                          within_2=met is not None and abs(met - good) <= 2,
                          prometheus_increase_missed={
                              r["metric"].get("reason"): float(r["value"][1])
                              for r in missed["data"]["result"]})
        board = json.load(open(os.path.join(DEPLOY, "grafana", "sloserve.json")))
        exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
        evaluated = []
        for e in exprs:  # at the run's end, while the 1 m windows still hold the load
            r = query(api, e, t1 - 2)
            evaluated.append({"expr": e, "status": r.get("status"), "error": r.get("error"),
                              "series": len(r.get("data", {}).get("result", []))})
        result["board"] = evaluated
        result["board_errors"] = [x["expr"] for x in evaluated if x["status"] != "success"]
        result["board_empty"] = [x["expr"] for x in evaluated
                                 if x["status"] == "success" and x["series"] == 0]
    finally:
        prom.close()
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "board"}, indent=1))


if __name__ == "__main__":
    main()
