"""What an idle spell costs the next decode steps, and what reading the weights first buys.

One engine core (the embedded model, one thread: pin it with ``taskset -c N``) serves requests
one at a time, each after ``--idle-s`` of sleep, with the prompt cached (its first step is one
token): the decode steps after the first are timed. With ``--prewarm P`` the worker reads its
decode weights P times before each request (``Worker.prewarm_weights``, in 4 parts, what a
decode instance does while a prompt's KV arrives). On a CPU whose last-level cache holds the
weights, the first steps after an idle spell are slower than warm ones.

Usage: ``taskset -c 1 python benchmarks/cold_weights.py [--idle-s 1.5] [--requests 10]``
(prints, per number of prewarm reads 0, 1 and 3, the median of each of the first 7 steps).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

PARTS = 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=1.5)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--prewarm", type=int, nargs="*", default=[0, 1, 3])
    a = ap.parse_args(argv)
    from sloserve.config import EngineConfig
    from sloserve.engine.core import EngineCore
    from sloserve.engine.messages import EngineCoreRequest
    from sloserve.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(num_threads=1))
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(128)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    n = 0

    def one(passes: int) -> list[float]:
        nonlocal n
        time.sleep(a.idle_s)
        for i in range(passes * PARTS):
            core.model_executor.collective_rpc("prewarm_weights", (i % PARTS, PARTS))
        n += 1
        core.add_request(EngineCoreRequest(f"r{n}", prompt, sp, time.monotonic()))
        steps = []
        while core.has_unfinished_requests():
            t = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - t)
        return steps[1:8]

    one(0)  # caches the prompt
    print(f"decode steps after {a.idle_s:g} s idle (ms; medians of {a.requests} requests)")
    for passes in a.prewarm:
        runs = [one(passes) for _ in range(a.requests)]
        med = [statistics.median(r[i] for r in runs) * 1e3 for i in range(len(runs[0]))]
        print(f"  prewarm reads {passes}: " + " ".join(f"{x:.1f}" for x in med))
    core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
