"""Debian's Prometheus on this host with deploy/prometheus's config (1 s scrape) and recording
rules, scraping one target, for the benchmarks that watch a live server
(``prometheus_check.py``, ``observability_overhead.py``)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import httpx

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalPrometheus:
    """Prometheus scraping ``target`` (host:port) every second; ``api`` is an httpx client of
    its HTTP API, ready once constructed. ``close()`` stops it and removes its data."""

    def __init__(self, target: str):
        self.work = tempfile.mkdtemp(prefix="prometheus-")
        with open(os.path.join(DEPLOY, "prometheus", "prometheus.yml")) as f:
            cfg = f.read().replace('"127.0.0.1:8000"', f'"{target}"')
        with open(os.path.join(self.work, "prometheus.yml"), "w") as f:
            f.write(cfg)
        shutil.copy(os.path.join(DEPLOY, "prometheus", "sloserve.rules.yml"), self.work)
        port = _free_port()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.work}/prometheus.yml",
             f"--storage.tsdb.path={self.work}/data", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        for _ in range(240):
            try:
                if self.api.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def close(self) -> None:
        self.api.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.work, ignore_errors=True)
