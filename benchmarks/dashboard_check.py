"""The dashboard against ``sloserve bench`` on a live server (issue 38's check, recorded): run a
bench of under a minute, keep ``/dashboard`` open in headless Chromium (Debian's, through
Playwright) meanwhile, then compare the page's windowed P50 TTFT with the bench's median TTFT
(every request of the run finished inside the page's 60 s window) and save a screenshot.

    sloserve serve --goodput ttft:1000 tpot:40 --port 8000 &
    .venv/bin/python benchmarks/dashboard_check.py --port 8000 --out-dir DIR -- \\
        --dataset-name random --random-input-len 256 --random-output-len 48 --num-prompts 60 \\
        --request-rate 3 --ignore-eos --goodput ttft:1000 tpot:40

Writes DIR/dashboard.png, DIR/bench.json (the bench's ``--save-detailed`` result) and
DIR/check.json (the page's snapshot, the two P50s, their ratio). Everything after ``--`` goes
to ``sloserve bench``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import httpx
from playwright.sync_api import sync_playwright


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    os.makedirs(a.out_dir, exist_ok=True)
    base = f"http://{a.host}:{a.port}"
    sloserve = os.path.join(os.path.dirname(sys.executable), "sloserve")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=a.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(base + "/dashboard")
        page.wait_for_function("window.__updates >= 1", timeout=30_000)
        t0 = time.monotonic()
        subprocess.run([sloserve, "bench", "--host", a.host, "--port", str(a.port),
                        "--save-result", "--save-detailed", "--result-dir", a.out_dir,
                        "--result-filename", "bench.json", *bench_args], check=True)
        ran = time.monotonic() - t0
        seq = httpx.get(base + "/stats", timeout=30).json()["seq"]
        page.wait_for_function(f"window.__stats && window.__stats.seq >= {seq}",
                               timeout=30_000)
        snap = page.evaluate("window.__stats")
        page.screenshot(path=os.path.join(a.out_dir, "dashboard.png"), full_page=True)
        browser.close()
    bench = json.load(open(glob.glob(os.path.join(a.out_dir, "bench.json"))[0]))
    page_p50, bench_p50 = snap["window"]["ttft_ms"]["p50"], bench["median_ttft_ms"]
    check = {"bench_seconds": ran, "window_requests": snap["window"]["requests"],
             "bench_completed": bench["completed"], "page_p50_ttft_ms": page_p50,
             "bench_median_ttft_ms": bench_p50, "ratio": page_p50 / bench_p50,
             "within_10_percent": abs(page_p50 / bench_p50 - 1) <= 0.10,
             "page_snapshot": snap}
    if ran > snap["window"]["seconds"]:
        check["note"] = "the bench ran longer than the page's window: not comparable"
    json.dump(check, open(os.path.join(a.out_dir, "check.json"), "w"), indent=1)
    print(json.dumps({k: v for k, v in check.items() if k != "page_snapshot"}, indent=1))


if __name__ == "__main__":
    main()
