"""The AMX kernels on vs off in one engine, alternated: step time of B decodes + a C-token chunk.

"On" is the engine as it starts here (AMX GEMM up to its measured crossover, AMX prefill
attention); "off" serves the same steps as an engine started with ``SLOSERVE_AMX=0`` would:
oneDNN for every dense step, torch's flash attention for prefill chunks, and the quantized-path
crossover re-measured without AMX. Rounds alternate the order, so a burst of load on these
shared machines hits both; medians of each round's median step are compared.

    .venv/bin/python benchmarks/amx_ab.py [--points 16+0,16+64,16+256,0+512] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics

from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
from sloserve.model.crossover import quant_crossover


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--points", default="16+0,16+16,16+64,16+256,16+496,0+512")
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    eng = LLM(max_num_batched_tokens=4096).engine
    model = eng.runner.model
    p = model.policy
    if model.kernels is None or not p.amx_max_tokens:
        raise SystemExit("no AMX GEMM in this engine (CPU without AMX, SLOSERVE_AMX=0 or float32)")
    k = model.kernels
    on = (p.amx_max_tokens, p.quant_max_tokens)
    p.amx_max_tokens, k.amx = 0, False
    off = (0, quant_crossover(model))

    def use(amx: bool) -> None:
        p.amx_max_tokens, p.quant_max_tokens = on if amx else off
        k.amx = amx
    print(f"on: AMX GEMM up to {on[0]} tokens, quantized up to {on[1]}; off: quantized up to "
          f"{off[1]}, oneDNN above")
    points = [tuple(int(v) for v in p.split("+")) for p in a.points.split(",")]
    res: dict = {}
    for r in range(a.rounds):
        for amx in ((True, False) if r % 2 == 0 else (False, True)):
            use(amx)
            for b, c in points:
                s = time_mixed_steps(eng, b, a.context_len, c, warmup=1, repeats=3)
                res.setdefault((b, c, amx), []).append(statistics.median(x.wall_s for x in s))
    use(True)
    print("| decodes + chunk | AMX on ms | AMX off ms | off / on |")
    print("|---|---|---|---|")
    for b, c in points:
        t_on, t_off = (statistics.median(res[(b, c, x)]) * 1e3 for x in (True, False))
        print(f"| {b} + {c} | {t_on:.1f} | {t_off:.1f} | {t_off / t_on:.2f} |")


if __name__ == "__main__":
    main()
