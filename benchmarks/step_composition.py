"""Step time of a hybrid batch: B running decodes plus one prefill chunk of C tokens.

This is the measurement behind the chunked-prefill experiment's result on a CPU. Chunking
(Sarathi-Serve, Agrawal et al. OSDI'24, section 3) cuts the TPOT tail because on a GPU a decode
step is memory-bound: prefill tokens added to it ride almost free up to the balance point, so
the decodes barely slow down while the prompt advances. Where the step's cost grows with every
token from the start, a chunk costs the decodes about as much time as the whole prefill would,
only spread over several steps; then chunking shortens the longest gap (max ITL) but not the sum
a request waits (its TPOT).

    .venv/bin/python benchmarks/step_composition.py [--dtype bfloat16] [--batches 1,8,16] [--rounds 3]

With ``--rounds N`` every (B, C) point is measured N times, the points alternated round by round
(so that a burst of load on a shared host hits all of them), and each row gives the fastest
round's median step.
"""
from __future__ import annotations

import argparse
import statistics

from sloserve.engine.llm import LLM
from sloserve.tools.step_profile import time_mixed_steps


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--chunks", default="0,16,32,64,128,256,512")
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    eng = LLM(dtype=a.dtype, max_num_batched_tokens=4096).engine
    print(f"embedded model, {eng.dtype_choice.dtype}, decodes at context ~{a.context_len}, median of "
          f"{a.repeats} steps")
    print("| decodes B | chunk C | step ms | added by the chunk ms | per prefill token ms | "
          "decode step share of the step |")
    print("|---|---|---|---|---|---|")
    points = [(int(b), int(c)) for b in a.batches.split(",") for c in a.chunks.split(",")]
    best = {p: float("inf") for p in points}
    for _ in range(a.rounds):
        for b, c in points:
            s = time_mixed_steps(eng, b, a.context_len, c, warmup=2, repeats=a.repeats)
            best[b, c] = min(best[b, c], statistics.median(x.wall_s for x in s) * 1e3)
    base = None
    for b, c in points:
        ms = best[b, c]
        if c == 0 or base is None or base[0] != b:
            base = (b, ms)
        per = f"{(ms - base[1]) / c:.2f}" if c else "-"
        print(f"| {b} | {c} | {ms:.1f} | {ms - base[1]:.1f} | {per} | {100 * base[1] / ms:.0f} % |",
              flush=True)


if __name__ == "__main__":
    main()
