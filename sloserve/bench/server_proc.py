"""A ``sloserve serve`` subprocess for demos and experiments: start, wait for /health, stop."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /health until 200.

    Raises:
        RuntimeError: the server process exited.
        TimeoutError: not healthy within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s} s")


@contextmanager
def sloserve_server(server_args: Sequence[str] = (), *, port: int = 0, log_level: str = "warning",
                    timeout_s: float = 300.0, quiet: bool = False,
                    log_path: str | None = None) -> Iterator[str]:
    """Run ``sloserve serve`` with ``server_args``; yields its base URL once healthy, stops it
    with SIGINT (then SIGKILL after 30 s) on exit. Its output goes to this process's
    stdout/stderr, nowhere (``quiet``) or the file ``log_path`` (overwritten).

    Raises:
        RuntimeError / TimeoutError: see :func:`wait_healthy`.
    """
    port = port or free_port()
    cmd = [sys.executable, "-m", "sloserve.cli", "serve", "--port", str(port),
           "--log-level", log_level, *server_args]
    log = open(log_path, "w", encoding="utf-8") if log_path else None  # noqa: SIM115
    out = log or (subprocess.DEVNULL if quiet else None)
    try:
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                stderr=out)
    finally:
        if log:
            log.close()  # the child holds its own descriptor
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, timeout_s)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape_metrics(base: str) -> dict[str, float]:
    """GET /metrics -> sample name -> value (summed over label sets; histogram buckets dropped)."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{base}/metrics", timeout=5, trust_env=False).text
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if not smp.name.endswith("_bucket"):
                vals[smp.name] = vals.get(smp.name, 0.0) + smp.value
    return vals
