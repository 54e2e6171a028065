"""Engine instances over a Ray cluster, the router in front: ``sloserve serve
--data-parallel-size N --data-parallel-backend ray`` (N replicas) and ``sloserve cluster
--num-prefill-instances P --num-decode-instances D`` (disaggregated).

Each instance is a ``sloserve serve`` child process on this host (its API process and engine
core: the scheduler) whose worker (model, KV cache, KV connector half) runs in a Ray actor
(``--distributed-executor-backend ray``) placed on the cluster's nodes in turn; Ray restarts a
worker actor that dies and the instance serves on. Prefill and decode workers' KV connectors
listen on their nodes' addresses (``kv_ip`` 0.0.0.0, a free port). Without ``--ray-address``
a local Ray cluster is started for them. The router (``sloserve.router``) serves on ``--port``
until SIGINT/SIGTERM, then the instances are stopped.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)


@dataclass
class Instance:
    role: str          # replica, prefill or decode
    port: int
    node_ip: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plan(roles: list[str], node_ips: list[str]) -> list[Instance]:
    """One instance per role, on the nodes in turn (prefill and decode instances alternate
    over the nodes from the first, so that P and D land on different nodes where there are
    two or more)."""
    return [Instance(r, free_port(), node_ips[i % len(node_ips)]) for i, r in enumerate(roles)]


def strip_flags(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` without ``flags`` (each taking one value, as ``--f v`` or ``--f=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _kv_config(role: str, user: str | None) -> str:
    cfg = json.loads(user) if user else {}
    cfg.update(kv_role="kv_producer" if role == "prefill" else "kv_consumer",
               kv_ip="0.0.0.0", kv_port=0)
    return json.dumps(cfg)


def _start_ray(address: str | None) -> str:
    import ray
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    return ray.get_runtime_context().gcs_address


def _node_ips() -> list[str]:
    import ray
    return sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})


def run_cluster(roles: list[str], serve_argv: list[str], host: str, port: int,
                ray_address: str | None, kv_transfer_config: str | None, router_argv: list[str],
                use_ray: bool = True, startup_timeout_s: float = 900.0) -> int:
    """Start the instances, wait for their /health, run the router until stopped; 0 on a
    clean stop, 1 when an instance failed to start. Without ``use_ray`` (``--data-parallel-
    backend mp``) the instances' workers stay in their engine cores' processes, here."""
    from sloserve.router.args import config_from_args, router_parser
    from sloserve.router.server import run_router

    address = _start_ray(ray_address) if use_ray else None
    instances = plan(roles, _node_ips() if use_ray else ["127.0.0.1"])
    exe = os.path.join(os.path.dirname(sys.executable), "sloserve")
    procs: list[subprocess.Popen] = []
    try:
        for inst in instances:
            cmd = [exe, "serve", *serve_argv, "--host", "127.0.0.1", "--port", str(inst.port)]
            if use_ray:
                cmd += ["--distributed-executor-backend", "ray", "--ray-address", address,
                        "--ray-node-ip", inst.node_ip]
            if inst.role != "replica":
                cmd += ["--kv-transfer-config", _kv_config(inst.role, kv_transfer_config)]
            logger.info("starting a %s instance on port %d (worker on %s)", inst.role, inst.port,
                        inst.node_ip)
            procs.append(subprocess.Popen(cmd))
        deadline = time.monotonic() + startup_timeout_s
        for inst, proc in zip(instances, procs):
            while True:
                if proc.poll() is not None:
                    logger.error("the %s instance on port %d exited with %d while starting",
                                 inst.role, inst.port, proc.returncode)
                    return 1
                try:
                    if httpx.get(f"http://127.0.0.1:{inst.port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    logger.error("the %s instance on port %d was not ready after %.0f s",
                                 inst.role, inst.port, startup_timeout_s)
                    return 1
                time.sleep(0.5)
        urls = {r: [f"http://127.0.0.1:{i.port}" for i in instances if i.role == r]
                for r in ("replica", "prefill", "decode")}
        args = ["--host", host, "--port", str(port), *router_argv]
        if urls["replica"]:
            args += ["--replicas", *urls["replica"]]
        else:
            args += ["--prefill", *urls["prefill"], "--decode", *urls["decode"]]
        run_router(config_from_args(router_parser().parse_args(args)))
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
