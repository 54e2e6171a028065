"""Start-up time and memory of `sloserve serve FILE.gguf` at default flags, per model file.

For each file: start the server (a fresh crossover cache the first time, so that the first start
measures the crossovers and the second reads them), poll `GET /health` every 0.1 s, record the
seconds to the first 200, the engine's start-up line ("weights: ..."), and the peak and steady
memory of the server's processes (the API process and the engine core): anonymous memory
(RssAnon: what the process itself allocated) and file-backed (RssFile: the GGUF's pages mapped
while it is read, which the OS can drop), sampled every 0.1 s until /health and once after a
short completion. Then stop it (SIGINT) and start it again.

    .venv/bin/python benchmarks/startup_memory.py FILE.gguf... --out FILE.json [--starts 2]
        [--serve-args "--kv-cache-memory 2"]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


def _mem(pids: list[int]) -> tuple[int, int]:
    anon = file = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        anon += int(line.split()[1]) * 1024
                    elif line.startswith("RssFile:"):
                        file += int(line.split()[1]) * 1024
        except OSError:
            pass
    return anon, file


def _tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return [pid]


def one_start(path: str, port: int, cache: str, timeout: float, extra: list[str]) -> dict:
    env = dict(os.environ, SLOSERVE_CROSSOVER_CACHE=cache)
    t0 = time.monotonic()
    cli = os.path.join(os.path.dirname(sys.executable), "sloserve")
    proc = subprocess.Popen([cli, "serve", path, "--port", str(port), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak_anon = peak_file = 0
    ready = None
    try:
        with httpx.Client(timeout=2.0) as c:
            while time.monotonic() - t0 < timeout:
                a, f = _mem(_tree(proc.pid))
                peak_anon, peak_file = max(peak_anon, a), max(peak_file, f)
                try:
                    if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        ready = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
            if ready is not None:
                model = c.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
                r = c.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120.0,
                           json={"model": model, "prompt": "Hello", "max_tokens": 8})
                r.raise_for_status()
        steady_anon, steady_file = _mem(_tree(proc.pid))
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    line = next((ln.split("]: ", 1)[-1] for ln in out.splitlines() if "weights: " in ln), None)
    cpu = next((ln.split("]: ", 1)[-1] for ln in out.splitlines() if " cpu: " in ln
                or "]: cpu:" in ln), None)
    return {"seconds_to_health": ready, "peak_anon_bytes": peak_anon,
            "peak_file_bytes": peak_file, "steady_anon_bytes": steady_anon,
            "steady_file_bytes": steady_file, "weights_line": line, "cpu_line": cpu,
            "log_tail": None if ready else out[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--serve-args", default="", help="more `sloserve serve` flags, one string")
    a = ap.parse_args()
    results = []
    for path in a.files:
        with tempfile.TemporaryDirectory() as d:
            cache = os.path.join(d, "crossovers.json")
            for i in range(a.starts):
                r = {"file": path, "file_bytes": os.path.getsize(path), "start": i + 1,
                     **one_start(path, a.port, cache, a.timeout, a.serve_args.split())}
                results.append(r)
                print(f"{os.path.basename(path)} start {i + 1}: "
                      f"{r['seconds_to_health'] and round(r['seconds_to_health'], 1)} s to /health, "
                      f"peak anon {r['peak_anon_bytes'] / 2**30:.2f} GiB (+ file "
                      f"{r['peak_file_bytes'] / 2**30:.2f}), steady anon "
                      f"{r['steady_anon_bytes'] / 2**30:.2f} GiB", flush=True)
                print(f"  {r['weights_line']}", flush=True)
    with open(a.out, "w") as f:
        json.dump({"argv": sys.argv, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
