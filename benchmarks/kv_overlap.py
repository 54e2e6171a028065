"""How much of a prompt's KV transfer the layer-wise push hides behind the prefill, on one
monotonic clock (CLOCK_MONOTONIC is one clock for every process of a machine).

A prefill instance (P) and a decode instance (D), each an engine core in its own process
pinned to its own CPU, with the KV connector in push mode over TCP on 127.0.0.1 (or, with
``--d-host``/``--d-netns``, across a veth between network namespaces). P prefills one
``--prompt-tokens`` prompt in one step (warmed up first on another prompt of that length); the
link is throttled by the sender's token bucket (``max_bandwidth``) or by ``tc`` on the veth
so that an eager transfer takes ``--link-share`` of the prefill's forward time (measured first,
without a connector). For ``none`` (no connector), ``eager`` and ``layerwise`` it reports:

* ``forward_s``: P's forward of the prompt (layer-wise must stay within 10 % of ``none``: the
  forward only queues blocks; a blocking send would fail this);
* ``exposed_s``: from P's forward end to D holding every layer (layer-wise <= 15 % of eager's);
* ``eager_vs_wire``: eager's exposed time over bytes / link rate (>= 0.9: the link is used);
* ``held_at_forward_end``: the share of the bytes D held when P's forward ended (layer-wise
  >= 0.5).

Usage: ``python benchmarks/kv_overlap.py [--prompt-tokens 2048] [--link-share 0.6]
[--out benchmarks/results/.../kv_overlap.json]``. Needs two CPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def _core(role: str | None, extra: dict, prompt_tokens: int, ray: dict | None = None):
    """An engine core; with ``ray`` (``ray_address``, ``ray_node_ip``) its worker (the model,
    the KV cache and the connector's worker half) runs in a Ray actor on that node."""
    from sloserve.config import EngineConfig
    from sloserve.engine.core import EngineCore

    kv = None
    if role is not None:
        kv = {"kv_role": role, "kv_port": extra.pop("kv_port", 0),
              "kv_ip": extra.pop("kv_ip", "127.0.0.1"),
              "kv_connector_extra_config": {"mode": "push", "incremental": False,
                                            "timeout_s": 600, **extra}}
    placement = dict(distributed_executor_backend="ray", **ray) if ray else {}
    return EngineCore(EngineConfig(max_num_batched_tokens=prompt_tokens, num_threads=1,
                                   enable_prefix_caching=False, kv_transfer_config=kv,
                                   **placement))


def _connector(core, fn):
    """``fn(connector)`` on the worker's KV connector, in the engine core's process or in the
    worker's Ray actor."""
    return core.model_executor.collective_rpc(lambda w: fn(w.model_runner.kv_connector))[0]


def _start_recording(conn) -> None:
    conn.events = []


def _recorded(conn) -> dict:
    return {"events": conn.events, "bytes": conn.bytes_received}


def _prompt(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _run(core, req) -> None:
    """Step ``req`` to its end; while nothing can run (KV in flight) sleep until the connector
    wakes the loop, as the server's core loop does (no busy polling beside P's prefill)."""
    import threading
    woken = threading.Event()
    core.set_wakeup(woken.set)
    core.add_request(req)
    while core.has_unfinished_requests():
        if core.step() is None:
            woken.wait(0.05)
            woken.clear()


def role_d(spec: dict) -> None:
    """The decode side: wait for one pushed transfer; print its receive timeline."""
    from sloserve.engine.messages import EngineCoreRequest, KVTransferParams
    from sloserve.sampling_params import SamplingParams

    core = _core("kv_consumer", {"kv_ip": spec["kv_ip"], "kv_port": spec["kv_port"]},
                 spec["prompt_tokens"], spec.get("d_ray"))
    _connector(core, _start_recording)
    print(json.dumps({"port": core.info.kv_port}), flush=True)
    _run(core, EngineCoreRequest("d", _prompt(spec["prompt_tokens"], 1),
                                 SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                 time.monotonic(), kv_transfer_params=KVTransferParams(
                                     do_remote_prefill=True, transfer_id="x")))
    print(json.dumps(_connector(core, _recorded)), flush=True)
    core.close()


def role_p(spec: dict) -> None:
    """The prefill side: warm up, then prefill the prompt (pushing it unless ``none``)."""
    from sloserve.engine.messages import EngineCoreRequest, KVTransferParams
    from sloserve.sampling_params import SamplingParams

    mode = spec["granularity"]
    extra = {"granularity": mode, "max_bandwidth": spec["rate"]} if mode != "none" else {}
    core = _core("kv_producer" if mode != "none" else None, extra, spec["prompt_tokens"],
                 spec.get("p_ray"))
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    _run(core, EngineCoreRequest("warm", _prompt(spec["prompt_tokens"], 2), sp, time.monotonic()))
    kv = None
    if mode != "none":
        _connector(core, _start_recording)
        kv = KVTransferParams(do_remote_decode=True, transfer_id="x",
                              remote_host=spec["d_host"], remote_port=spec["d_port"])
    _run(core, EngineCoreRequest("p", _prompt(spec["prompt_tokens"], 1), sp, time.monotonic(),
                                 kv_transfer_params=kv))
    # the step before the transfer's end: its runner output is the prompt's forward
    out = {"forward_s": core.last_runner_output.forward_s,
           "kv_bytes_per_token": core.kv_cache_spec.bytes_per_token}
    if mode != "none":
        out["events"] = _connector(core, _recorded)["events"]
    print(json.dumps(out), flush=True)
    core.close()


def _spawn(role: str, spec: dict, cpu: int, netns: str | None) -> subprocess.Popen:
    cmd = [sys.executable, HERE, f"_{role}", json.dumps(spec)]
    cmd = ["taskset", "-c", str(cpu)] + cmd
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _last_json(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"a side exited with {proc.wait()}")
    return json.loads(line)


def measure(granularity: str, a, rate: float | None) -> dict:
    spec = {"prompt_tokens": a.prompt_tokens, "granularity": granularity, "rate": rate,
            "kv_ip": a.d_bind, "kv_port": a.kv_port, "d_host": a.d_host}
    if a.ray_address:
        spec["p_ray"] = {"ray_address": a.ray_address, "ray_node_ip": a.p_node_ip}
        spec["d_ray"] = {"ray_address": a.ray_address, "ray_node_ip": a.d_node_ip}
    # D runs beside P in every case (also ``none``, waiting for a transfer that never comes):
    # the two CPUs may share a core's caches and memory bandwidth
    d = _spawn("d", spec, 1, a.d_netns)
    spec["d_port"] = _last_json(d)["port"]
    p = _spawn("p", spec, 0, a.p_netns)
    pres = _last_json(p)
    if granularity == "none":
        p.wait()
        d.kill()
        d.wait()
        return pres
    dres = _last_json(d)
    p.wait()
    d.wait()
    ev_p = {name: t for t, name, _ in pres["events"]}
    recv = [(t, b) for t, name, b in dres["events"] if name == "received"]
    done = [t for t, name, _ in dres["events"] if name == "done"][-1]
    fwd_end = ev_p["forward_end"]
    total = dres["bytes"]
    held = max([b for t, b in recv if t <= fwd_end], default=0)
    return {"forward_s": pres["forward_s"], "bytes": total, "exposed_s": done - fwd_end,
            "held_at_forward_end": held / total,
            "forward_start_to_done_s": done - ev_p["forward_start"]}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("_p", "_d"):
        (role_p if args[0] == "_p" else role_d)(json.loads(args[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--link-share", type=float, default=0.6,
                    help="eager transfer time over the prefill's forward (default 0.6)")
    ap.add_argument("--rate", default=None,
                    help="link rate instead (bytes/s or 0.4gbit-style), e.g. the tc rate; "
                         "with --no-token-bucket the connector does not throttle itself")
    ap.add_argument("--no-token-bucket", action="store_true",
                    help="the link (tc) throttles, not the connector's max_bandwidth")
    ap.add_argument("--p-netns", default=None, help="run P in this network namespace")
    ap.add_argument("--d-netns", default=None, help="run D in this network namespace")
    ap.add_argument("--d-host", default="127.0.0.1", help="D's address as P reaches it")
    ap.add_argument("--d-bind", default="127.0.0.1", help="the address D listens on")
    ap.add_argument("--kv-port", type=int, default=0)
    ap.add_argument("--ray-address", default=None,
                    help="run P's and D's workers as Ray actors of this cluster")
    ap.add_argument("--p-node-ip", default=None, help="the Ray node for P's worker")
    ap.add_argument("--d-node-ip", default=None, help="the Ray node for D's worker")
    ap.add_argument("--tc-dev", default=None,
                    help="throttle this device with tc tbf at the link rate (in --tc-netns); "
                         "implies --no-token-bucket")
    ap.add_argument("--tc-netns", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(args)
    from sloserve.argtypes import parse_bandwidth

    runs = {"none": [], "eager": [], "layerwise": []}
    first = measure("none", a, None)  # sizes the link; not in the figures
    fwd = first["forward_s"]
    kv_bytes = first["kv_bytes_per_token"] * a.prompt_tokens
    rate = parse_bandwidth(a.rate) if a.rate else kv_bytes / (a.link_share * fwd)
    if a.tc_dev:
        a.no_token_bucket = True
        ns = ["ip", "netns", "exec", a.tc_netns] if a.tc_netns else []
        subprocess.run(ns + ["tc", "qdisc", "replace", "dev", a.tc_dev, "root", "tbf", "rate",
                             f"{int(rate * 8)}bit", "burst", "64kb", "latency", "200ms"],
                       check=True)
    bucket = None if a.no_token_bucket else rate
    for _ in range(a.repeats):  # interleaved: drift hits all alike
        for g in ("none", "eager", "layerwise"):
            runs[g].append(measure(g, a, bucket))
    fwd = sorted(r["forward_s"] for r in runs["none"])[len(runs["none"]) // 2]

    def med(g, k):
        v = sorted(r[k] for r in runs[g])
        return v[len(v) // 2]
    eager, lw = med("eager", "exposed_s"), med("layerwise", "exposed_s")
    summary = {
        "prompt_tokens": a.prompt_tokens, "kv_bytes": kv_bytes, "link_rate_Bps": rate,
        "wire_s": kv_bytes / rate, "forward_s": {g: med(g, "forward_s") for g in runs},
        "exposed_s": {"eager": eager, "layerwise": lw},
        "layerwise_over_eager_exposed": lw / eager,
        "eager_vs_wire": eager / (kv_bytes / rate),
        "layerwise_forward_over_none": med("layerwise", "forward_s") / fwd,
        "held_at_forward_end": {g: med(g, "held_at_forward_end") for g in ("eager", "layerwise")},
        "runs": runs, "host": os.uname().nodename,
        "throttle": "tc on the link" if a.no_token_bucket else "the connector's token bucket",
        "workers": (f"Ray actors on nodes {a.p_node_ip} (P) and {a.d_node_ip} (D) of "
                    f"{a.ray_address}") if a.ray_address else "in the engine cores' processes",
    }
    text = json.dumps(summary, indent=1)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
