"""What watching costs (issue 38's check, recorded): the same ``sloserve bench`` against one
live server, in turn plain, watched (Prometheus, Debian's, scraping ``/metrics`` every second
with deploy/prometheus's config and rules, and a client reading ``/stats/stream?steps=true``
every second as the dashboard page does: the server's side of watching) and watched in a
browser on this host (the same Prometheus and ``/dashboard`` open in headless Chromium, Debian's
through Playwright: the page's own drawing shares the server's cores), ``--rounds`` times each;
the output tok/s of each run, their medians and their ratios to plain.

    sloserve serve --goodput ttft:1000 tpot:50 --port 8000 &
    .venv/bin/python benchmarks/observability_overhead.py --port 8000 --rounds 3 \\
        --out results/DIR/overhead.json -- --dataset-name random --random-input-len 256 \\
        --random-output-len 128 --num-prompts 64 --max-concurrency 16 --ignore-eos

Everything after ``--`` goes to ``sloserve bench``; each run gets its own ``--seed`` (the
same prompts again would be served from the prefix cache).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx

from prometheus_local import LocalPrometheus


class Watchers:
    """Prometheus scraping the target every second and the dashboard open in Chromium."""

    def __init__(self, target: str, chromium: str | None):
        self.prom = LocalPrometheus(target)
        self.events = 0
        self.browser = None
        if chromium is None:  # the page's requests without the page
            self._stop = threading.Event()
            self._reader = threading.Thread(target=self._read, args=(target,), daemon=True)
            self._reader.start()
        else:
            from playwright.sync_api import sync_playwright
            self._pw = sync_playwright().start()
            self.browser = self._pw.chromium.launch(executable_path=chromium,
                                                    args=["--no-sandbox"])
            self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
            self.page.goto(f"http://{target}/dashboard")
            self.page.wait_for_function("window.__updates >= 1", timeout=30_000)
        time.sleep(2)  # a few scrapes before the load

    def _read(self, target: str) -> None:
        with httpx.stream("GET", f"http://{target}/stats/stream",
                          params={"interval": 1, "steps": "true"}, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.events += 1
                if self._stop.is_set():
                    return

    def updates(self) -> int:
        return self.events if self.browser is None else self.page.evaluate("window.__updates")

    def close(self) -> None:
        if self.browser is None:
            self._stop.set()
            self._reader.join(timeout=5)
        else:
            self.browser.close()
            self._pw.stop()
        self.prom.close()


def bench(host: str, port: int, args: list[str], out_dir: str, name: str) -> dict:
    sloserve = os.path.join(os.path.dirname(sys.executable), "sloserve")
    subprocess.run([sloserve, "bench", "--host", host, "--port", str(port), "--save-result",
                    "--result-dir", out_dir, "--result-filename", name, "--disable-tqdm",
                    *args], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench_args = a.bench_args[1:] if a.bench_args[:1] == ["--"] else a.bench_args
    out_dir = os.path.dirname(os.path.abspath(a.out))
    os.makedirs(out_dir, exist_ok=True)
    modes = ("plain", "watched", "watched_browser")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    updates: dict[str, list[int]] = {m: [] for m in modes[1:]}
    for r in range(a.rounds):
        for k, mode in enumerate(modes):
            w = (None if mode == "plain" else
                 Watchers(f"{a.host}:{a.port}", a.chromium if mode == "watched_browser" else None))
            try:
                u0 = w.updates() if w else 0
                seed = 1000 + len(modes) * r + k
                res = bench(a.host, a.port, [*bench_args, "--seed", str(seed)], out_dir,
                            f"overhead_{mode}_{r}.json")
                if w:
                    updates[mode].append(w.updates() - u0)
            finally:
                if w:
                    w.close()
            runs[mode].append(res["output_throughput"])
            print(f"round {r + 1} {mode}: {res['output_throughput']:.1f} output tok/s",
                  flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    out = {"command": " ".join(sys.argv), "output_tok_s": runs, "median": med,
           "over_plain": {m: med[m] / med["plain"] for m in modes[1:]},
           "snapshots_read_per_run": updates}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "command"}, indent=1))


if __name__ == "__main__":
    main()
