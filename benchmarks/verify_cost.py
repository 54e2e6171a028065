"""What a verify step of 1 + k tokens per request costs over a decode step (speculative
decoding's price), per batch size, on the engine alone (no server):

    PYTHONPATH=$PWD .venv/bin/python -P benchmarks/verify_cost.py --out FILE.json
    ... --batches 1,4,16 --ks 0,1,2,4,8 --context 256 --steps 30 --rounds 2

Each cell is the median of ``--steps`` steps (after 3 warm-up steps), every request with k
draft tokens that are all rejected (``sloserve.tools.step_profile.time_decode_steps``), the
rounds interleaved. Printed per batch and k: the step's median ms, its ratio over k = 0, and that
ratio read as the break-even mean acceptance length (tokens per step a request must gain for
drafts of k to pay). Where (1 + k) x batch crosses the quantized kernels' step limit
(``quant_max_tokens``, in the engine's start-up line) the step moves to the dense GEMM.
"""
from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ks", default="0,1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.tools.step_profile import time_decode_steps
    batches = [int(x) for x in a.batches.split(",")]
    ks = [int(x) for x in a.ks.split(",")]
    ctx = a.context + a.steps
    eng = LLMEngine(EngineConfig(dtype=a.dtype, max_num_batched_tokens=max(batches) * ctx,
                                 max_num_seqs=max(batches), num_kv_blocks=max(batches) *
                                 (-(-(ctx + 64) // 16)) + 16))
    print(eng.core.info.dtype_reason, flush=True)
    cells: dict[tuple[int, int], list[float]] = {}
    for r in range(a.rounds):
        for b in batches:
            for k in ks:
                ss = time_decode_steps(eng, b, ctx, warmup=3, repeats=a.steps, spec_tokens=k)
                cells.setdefault((b, k), []).append(statistics.median(s.wall_s for s in ss) * 1e3)
    rows = []
    print("| batch | k | step (ms, median per round) | over k = 0 |")
    print("|---:|---:|---|---:|")
    for b in batches:
        base = statistics.median(cells[(b, 0)]) if (b, 0) in cells else None
        for k in ks:
            ms = cells[(b, k)]
            ratio = statistics.median(ms) / base if base else None
            rows.append({"batch": b, "k": k, "step_ms": ms, "over_decode": ratio})
            print(f"| {b} | {k} | {' / '.join(f'{x:.2f}' for x in ms)} | "
                  f"{'-' if ratio is None else f'{ratio:.2f}'} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"context": a.context, "steps": a.steps, "rows": rows,
                       "engine": eng.core.info.dtype_reason}, f, indent=2)


if __name__ == "__main__":
    main()
