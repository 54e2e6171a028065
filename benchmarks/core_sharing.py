"""The engine quiet and beside a busy neighbour on one core, per thread setting (issue 33).

    .venv/bin/python benchmarks/core_sharing.py --rounds 3 --out FILE.json \\
        --config base@/tmp/base= --config new= --config t1=OMP_NUM_THREADS=1
    .venv/bin/python benchmarks/core_sharing.py --serve --rounds 2 --config base@/tmp/base= \\
        --config new=

A configuration ``NAME[@TREE]=ENV`` is a checkout (``TREE``, default this one, run with
``PYTHONPATH=TREE``: an older commit's ``git archive`` unpacked gives a before/after pair) and
environment variables (``ENV``: space-separated ``KEY=VALUE`` pairs, empty for none; libgomp
reads them when it loads). The neighbour is ``taskset -c CPU sh -c 'while :; do :; done'`` in a
session of its own (another program's process, not one of ours), at this process's priority;
``--neighbour-nice N --neighbour-session ours`` makes it one like the engine's own low-priority
children (grammar compiles). ``OMP_NUM_THREADS=N`` in a configuration fixes the thread count
(no governor).

Engine steps (default): each configuration is one engine process (``LLMEngine``), loaded once
with the crossovers pinned (quantized steps up to 16 tokens, AMX up to 2,048, so that a loaded
start-up cannot move them). Per round and step kind (pure-decode steps of batch 1 and of 16 at
context ~128, a 512-token prefill) the processes take turns, all of them quiet, then all of them
beside the neighbour, the order rotated every round: every configuration runs within seconds of
the others, under the same background load. Before each measurement a process runs
``--settle`` seconds of untimed decode steps under the same load (the engine adapts its thread
count to it). Prints each measurement (median / mean / max step ms, the thread count after)
and, at the end, per configuration and kind the mean step time quiet and beside the neighbour
over all rounds, their ratio, and both relative to the first configuration. ``--quiet-only``
leaves the neighbour out (a before/after of the quiet speed); ``--wait-idle 0.85`` waits for a
pause in other jobs before each step kind.

``--serve``: per round and configuration, ``sloserve serve`` (crossovers pinned the same way,
through ``benchmarks/pin_crossovers``) and ``sloserve bench`` at concurrency 1 and 16
(``random`` 128 in / 64 out, ``--ignore-eos``), each quiet and then beside the neighbour; prints
mean TPOT and output tok/s and, at the end, their neighbour / quiet ratios (issue 33's bar: c=1
TPOT and c=16 tok/s within 2.5x of quiet).

On a shared machine compare within a round and quote ratios.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEIGHBOUR = "while :; do :; done"
KINDS = ("decode_1", "decode_16", "prefill_512")
PIN = "16,2048"  # quantized steps up to 16 tokens, AMX up to 2,048


def _stats(xs: list[float]) -> dict:
    ms = [x * 1e3 for x in xs]
    return {"median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "p99_ms": sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))], "max_ms": max(ms),
            "n": len(ms)}


@contextlib.contextmanager
def neighbour(cpu: int | None, nice: int = 0, own_session: bool = True):
    """A busy loop pinned to ``cpu`` (None: none) at ``nice`` more than this process, in a
    session of its own or in this one (with session autogroups on, a nice value counts only
    within a session)."""
    if cpu is None:
        yield
        return
    nb = subprocess.Popen(["taskset", "-c", str(cpu), "nice", "-n", str(nice), "sh", "-c",
                           NEIGHBOUR], start_new_session=own_session,
                          process_group=None if own_session else 0)
    time.sleep(0.2)
    try:
        yield
    finally:
        nb.kill()
        nb.wait()


def config_env(tree: str, env_text: str, pin: bool = False) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.path.abspath(tree)
    if pin:
        env["PYTHONPATH"] += os.pathsep + os.path.join(HERE, "benchmarks", "pin_crossovers")
        env["SLOSERVE_PIN_CROSSOVERS"] = PIN
    for kv in shlex.split(env_text):
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def idle_share(seconds: float) -> float:
    """The share of the machine's CPU time that was idle over the next ``seconds``."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v[3] + v[4], sum(v)
    i0, t0 = read()
    time.sleep(seconds)
    i1, t1 = read()
    return (i1 - i0) / max(1, t1 - t0)


def wait_quiet(min_idle: float, timeout_s: float = 900.0) -> float:
    """Wait (up to ``timeout_s``) until the CPUs were at least ``min_idle`` idle over 2 s; the
    idle share seen last."""
    end = time.monotonic() + timeout_s
    while True:
        share = idle_share(2.0)
        if share >= min_idle or time.monotonic() > end:
            return share


# ----------------------------------------------------------------------------- engine steps
def settle(eng, seconds: float) -> None:
    """Untimed decode steps of batch 4 for ``seconds`` on requests of their own."""
    from sloserve.tools.step_profile import start_decodes
    if seconds <= 0:
        return
    ids = start_decodes(eng, 4, 64, 4000)
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        eng.step()
    for rid in ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()


def child(steps: int, settle_s: float) -> None:
    """Load the engine, say ``READY``, then answer each ``KIND`` line on stdin with one JSON
    line of that kind's step times (after ``settle_s`` seconds of untimed steps)."""
    import torch

    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.model import crossover
    from sloserve.tools.step_profile import time_decode_steps, time_prefill_steps

    quant, amx = (int(v) for v in PIN.split(","))
    crossover.quant_crossover = lambda *a, **k: quant
    crossover.amx_crossover = lambda *a, **k: amx
    eng = LLMEngine(EngineConfig(max_num_batched_tokens=2048, num_kv_blocks=320))
    print("READY " + json.dumps({"torch_threads": torch.get_num_threads(),
                                 "cpu_line": eng.dtype_choice.describe()}), flush=True)
    while True:
        kind = sys.stdin.readline().strip()
        if kind not in KINDS:
            return
        settle(eng, settle_s)
        if kind == "decode_1":
            ss = time_decode_steps(eng, 1, 128, warmup=2, repeats=steps)
        elif kind == "decode_16":
            ss = time_decode_steps(eng, 16, 128, warmup=2, repeats=steps)
        else:
            eng.reset_prefix_cache()  # the same prompts every time: no cache hits
            ss = time_prefill_steps(eng, 512, warmup=1, repeats=3)
        print("RESULT " + json.dumps(dict(_stats([s.wall_s for s in ss]),
                                          threads=torch.get_num_threads())), flush=True)


class Child:
    def __init__(self, name: str, env_text: str, tree: str, steps: int, settle_s: float):
        self.name, self.env_text, self.tree = name, env_text, tree
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "--child",
                                      "--steps", str(steps), "--settle", str(settle_s)],
                                     env=config_env(tree, env_text), cwd=tree, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.info = json.loads(self._expect("READY "))

    def _expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):]
        raise RuntimeError(f"{self.name}: the engine process ended (exit {self.proc.wait()})")

    def measure(self, kind: str) -> dict:
        time.sleep(0.05)  # the previous process's OpenMP threads stop spinning
        self.proc.stdin.write(kind + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def steps_main(a, configs) -> dict:
    kinds = a.kinds.split(",")
    children, rows = [], []
    try:
        for name, tree, env_text in configs:
            children.append(Child(name, env_text, tree, a.steps, a.settle))
            print(f"{name}: {children[-1].info['cpu_line']}", flush=True)
        for r in range(a.rounds):
            order = children[r % len(children):] + children[:r % len(children)]
            for kind in kinds:
                if a.wait_idle:
                    share = wait_quiet(a.wait_idle)
                    print(f"round {r} {kind:>11}: the machine {100 * share:.0f} % idle before",
                          flush=True)
                for busy in (False, True)[:1 if a.quiet_only else 2]:
                    with neighbour(a.cpu if busy else None, a.neighbour_nice,
                                   a.neighbour_session == "own"):
                        for c in order:
                            s = c.measure(kind)
                            rows.append(dict(s, name=c.name, kind=kind, neighbour=busy, round=r))
                            print(f"round {r} {kind:>11} {'neighbour' if busy else 'quiet':>9} "
                                  f"{c.name:>12}: median {s['median_ms']:7.1f} mean "
                                  f"{s['mean_ms']:7.1f} P99 {s['p99_ms']:7.1f} max {s['max_ms']:7.1f} ms, "
                                  f"{s['threads']} threads after", flush=True)
    finally:
        for c in children:
            c.close()

    def mean(name, kind, busy):
        return statistics.fmean([x["mean_ms"] for x in rows if (x["name"], x["kind"],
                                                                x["neighbour"]) == (name, kind, busy)]
                                or [math.nan])
    ref = configs[0][0]
    print(f"\nmean step ms over {a.rounds} rounds: quiet / neighbour (ratio); vs {ref}: quiet, "
          f"neighbour")
    for kind in kinds:
        for name, _, _ in configs:
            q, n = mean(name, kind, False), mean(name, kind, True)
            print(f"  {kind:>11} {name:>12}: {q:7.1f} / {n:7.1f} ({n / q:5.2f}x); "
                  f"{q / mean(ref, kind, False):5.2f}x, {n / mean(ref, kind, True):5.2f}x")
    return {"configs": [dict(c.info, name=c.name, env=c.env_text, tree=c.tree)
                        for c in children], "rows": rows}


# ----------------------------------------------------------------------------- the server
def bench(base: str, concurrency: int, num_prompts: int, tmp: str) -> dict:
    name = f"bench-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-P", "-c", "import sys; from sloserve.cli import main; "
                    "sys.exit(main())", "bench", "--base-url", base, "--dataset-name", "random",
                    "--random-input-len", "128", "--random-output-len", "64",
                    "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                    "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", tmp,
                    "--result-filename", name], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=HERE))
    with open(os.path.join(tmp, name)) as f:
        return json.load(f)


def serve_main(a, configs) -> dict:
    sys.path.insert(0, HERE)
    from sloserve.bench.server_proc import free_port, wait_healthy
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, tree, env_text in configs[r % len(configs):] + configs[:r % len(configs)]:
                port = free_port()
                proc = subprocess.Popen([sys.executable, "-P", "-c", "import sys; from "
                                         "sloserve.cli import main; sys.exit(main())", "serve",
                                         "--port", str(port), "--log-level", "warning"],
                                        env=config_env(tree, env_text, pin=True), cwd=tree)
                base = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(base, proc, 300)
                    bench(base, 1, 2, tmp)  # warm-up
                    for conc, n in ((1, a.serve_prompts_c1), (16, a.serve_prompts_c16)):
                        if a.wait_idle:
                            wait_quiet(a.wait_idle)
                        for busy in (False, True):
                            with neighbour(a.cpu if busy else None, a.neighbour_nice,
                                   a.neighbour_session == "own"):
                                res = bench(base, conc, n, tmp)
                            row = {"round": r, "name": name, "concurrency": conc,
                                   "neighbour": busy, "mean_tpot_ms": res["mean_tpot_ms"],
                                   "p99_tpot_ms": res["p99_tpot_ms"],
                                   "output_throughput": res["output_throughput"]}
                            rows.append(row)
                            print(f"round {r} {name:>12} c={conc:<2} "
                                  f"{'neighbour' if busy else 'quiet':>9}: mean TPOT "
                                  f"{row['mean_tpot_ms']:7.1f} ms, P99 {row['p99_tpot_ms']:7.1f}"
                                  f" ms, {row['output_throughput']:6.1f} tok/s", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)

    def get(name, conc, busy, key):
        return statistics.fmean(x[key] for x in rows if (x["name"], x["concurrency"],
                                                         x["neighbour"]) == (name, conc, busy))
    print(f"\nover {a.rounds} rounds: c=1 mean TPOT quiet / neighbour (ratio); c=16 tok/s "
          f"quiet / neighbour (quiet / neighbour)")
    for name, _, _ in configs:
        t_q, t_n = get(name, 1, False, "mean_tpot_ms"), get(name, 1, True, "mean_tpot_ms")
        s_q, s_n = (get(name, 16, False, "output_throughput"),
                    get(name, 16, True, "output_throughput"))
        print(f"  {name:>12}: c=1 {t_q:6.1f} / {t_n:6.1f} ms ({t_n / t_q:5.2f}x); c=16 "
              f"{s_q:6.1f} / {s_n:6.1f} tok/s ({s_q / s_n:5.2f}x)")
    return {"configs": [{"name": n, "tree": t, "env": e} for n, t, e in configs], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=[], metavar="NAME[@TREE]=ENV")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="decode steps per measurement")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of untimed decode steps before each measurement")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="SHARE",
                    help="before each step kind (--serve: each concurrency), wait (up to 15 min) "
                         "until the machine was this share idle over 2 s (e.g. 0.85: other jobs "
                         "paused)")
    ap.add_argument("--quiet-only", action="store_true",
                    help="engine steps without the neighbour (a quiet-speed comparison)")
    ap.add_argument("--serve", action="store_true", help="measure through the server")
    ap.add_argument("--serve-prompts-c1", type=int, default=6)
    ap.add_argument("--serve-prompts-c16", type=int, default=32)
    ap.add_argument("--cpu", type=int, default=1, help="the core the neighbour is pinned to")
    ap.add_argument("--neighbour-nice", type=int, default=0, help="the neighbour's nice value")
    ap.add_argument("--neighbour-session", choices=("own", "ours"), default="own",
                    help="the neighbour in a session of its own (another program's, default) "
                         "or in ours (as the engine's own child processes are)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.steps, a.settle)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the finally blocks clean up
    configs = []
    for spec in a.config or ["this="]:
        name, _, env_text = spec.partition("=")
        name, _, tree = name.partition("@")
        configs.append((name, tree or HERE, env_text))
    res = serve_main(a, configs) if a.serve else steps_main(a, configs)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(res, when=time.strftime("%Y-%m-%d %H:%M"), mode="serve" if a.serve
                           else "steps"), f, indent=2)


if __name__ == "__main__":
    main()
