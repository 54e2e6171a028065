"""`sloserve cluster`: a prefill and a decode instance whose workers run in Ray actors on two
Ray nodes (two `ray start` on this host with different node addresses: the KV goes from one
node's address to the other's), the router in front; greedy output equal to one engine's; a
worker actor killed is restarted by Ray and its instance serves again through the router."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sloserve.router.cluster import Instance, plan, strip_flags

pytest.importorskip("ray")


def test_strip_flags_and_placement():
    argv = ["M", "--port", "1", "--dtype=float32", "--data-parallel-size=2", "--host", "h", "-x"]
    assert strip_flags(argv, {"--port", "--host", "--data-parallel-size"}) == \
        ["M", "--dtype=float32", "-x"]
    got = plan(["prefill", "decode", "decode"], ["10.0.0.1", "10.0.0.2"])
    assert [(i.role, i.node_ip) for i in got] == [("prefill", "10.0.0.1"), ("decode", "10.0.0.2"),
                                                  ("decode", "10.0.0.1")]
    assert all(isinstance(i, Instance) and i.port > 0 for i in got)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(port: int, prompt: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
        "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


@pytest.fixture
def two_ray_nodes():
    """A head node and a second node at 127.0.0.2 (Ray registers the head at the host's own
    address); each `ray start --block` in the foreground, so that stopping it stops only the
    processes it started (``ray stop`` would end every Ray on the host). Yields the address
    and the nodes' Ray temp dir."""
    import shutil
    import tempfile
    gcs = _free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    # its own Ray temp dir: the sessions, and the head's /tmp/ray/ray_current_cluster (which
    # a later ray.init() on this host would take for a live cluster), stay out of /tmp/ray
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": tmp}
    common = ["--num-cpus", "1", "--object-store-memory", "80000000", "--block"]
    nodes = [subprocess.Popen([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1",
                               "--port", str(gcs), "--include-dashboard", "false", *common],
                              env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        t = time.monotonic()
        while True:  # the second node joins once the head's GCS answers
            assert nodes[0].poll() is None, "ray start --head exited"
            probe = subprocess.run([ray_bin, "health-check", "--address", f"127.0.0.1:{gcs}"],
                                   env=env, capture_output=True)
            if probe.returncode == 0:
                break
            assert time.monotonic() - t < 120
            time.sleep(0.5)
        nodes.append(subprocess.Popen([ray_bin, "start", "--address", f"127.0.0.1:{gcs}",
                                       "--node-ip-address", "127.0.0.2", *common], env=env,
                                      start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        count = ("import ray, sys, time\n"
                 "ray.init(address=sys.argv[1], log_to_driver=False)\n"
                 "t = time.monotonic()\n"
                 "while sum(n['Alive'] for n in ray.nodes()) < 2 and time.monotonic() - t < 120:\n"
                 "    time.sleep(0.2)\n"
                 "sys.exit(sum(n['Alive'] for n in ray.nodes()) < 2)\n")
        assert subprocess.run([sys.executable, "-c", count, f"127.0.0.1:{gcs}"], env=env,
                              capture_output=True).returncode == 0, "the second node never joined"
        yield f"127.0.0.1:{gcs}", tmp
    finally:
        for n in nodes:
            os.killpg(n.pid, signal.SIGTERM)
        for n in nodes:  # a node that has not stopped in 5 s: its whole process group goes
            try:
                n.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(n.pid, signal.SIGKILL)
                n.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def test_cluster_serves_pd_through_the_router_and_survives_a_killed_worker(tiny_llama_dir,
                                                                           two_ray_nodes,
                                                                           monkeypatch):
    import sloserve
    from sloserve.sampling_params import SamplingParams

    prompt = "The capital of France is a city of many bridges and old streets"
    engine = ["--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "4",
              "--num-threads", "1", "--served-model-name", "m"]
    ref = sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4)
    want = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].text
    del ref
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "sloserve")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_TMPDIR", two_ray_nodes[1])
    proc = subprocess.Popen([exe, "cluster", "--num-prefill-instances", "1",
                             "--num-decode-instances", "1", "--port", str(port),
                             "--ray-address", two_ray_nodes[0],
                             "--log-level", "warning", tiny_llama_dir, *engine],
                            start_new_session=True)
    try:
        t = time.monotonic()
        while True:
            assert proc.poll() is None, "sloserve cluster exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t < 300
            time.sleep(0.5)
        # the prefill and the decode instance's workers are on the two nodes: each connector
        # listens on its own node's address
        workers = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["workers"]
        hosts = {w["role"]: httpx.get(w["url"] + "/kv_transfer", timeout=5).json()["kv_host"]
                 for w in workers}
        assert set(hosts) == {"prefill", "decode"} and hosts["prefill"] != hosts["decode"]
        assert "127.0.0.2" in hosts.values()
        r = _complete(port, prompt)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        # kill one worker actor's process (Ray restarts it; its instance serves on)
        pids = subprocess.run(["pgrep", "-f", "RayWorkerWrapper"], capture_output=True,
                              text=True).stdout.split()
        assert len(pids) >= 2
        os.kill(int(pids[-1]), signal.SIGKILL)
        t = time.monotonic()
        while True:  # requests may fail while the actor restarts; then they are served again
            r = _complete(port, prompt)
            if r.status_code == 200:
                break
            assert time.monotonic() - t < 120, r.text
            time.sleep(0.5)
        assert r.json()["choices"][0]["text"] == want
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert [w["state"] for w in health["workers"]] == ["healthy", "healthy"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
