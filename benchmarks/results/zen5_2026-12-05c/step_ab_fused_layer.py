"""Step wall times, the fused layer call (FastPath.fused_layers) vs the separate kernels,
alternated in one process (median of 5 steps, min over rounds). Points B:C = decodes at context
256 : chunk tokens.

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/step_ab_fused_layer.py 4 1:0,16:0
"""
import statistics, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
points = [tuple(int(v) for v in p.split(":")) for p in (sys.argv[2] if len(sys.argv) > 2 else "1:0,4:0,16:0,16:64,16:256,0:512").split(",")]
best = {}
for r in range(rounds):
    for p in points:
        for name in ("separate", "fused"):
            fp.fused_layers = name == "fused"
            s = time_mixed_steps(eng, p[0], 256, p[1], warmup=2, repeats=5)
            best.setdefault((p, name), []).append(statistics.median(x.wall_s for x in s) * 1e3)
for p in points:
    a, b = best[p, "separate"], best[p, "fused"]
    print(f"B={p[0]:3d} C={p[1]:4d} separate {min(a):7.2f} (med {statistics.median(a):7.2f})  fused {min(b):7.2f} (med {statistics.median(b):7.2f})  ratio {min(b)/min(a):.3f}")
