"""Step wall times (median of 5 steps, min over rounds): the library built from d39a08a's
kernels.cpp with separate kernel calls per layer vs the current library with the fused layer
call, alternated in one process. Build both with build_variant.sh first (start: from
`git show d39a08a:sloserve/kernels/csrc/kernels.cpp`, to /tmp/w/lib_start.so; now: the
current source, to /tmp/w/lib_now.so). Points B:C = decodes at context 256 : chunk tokens.

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/step_ab_session_start.py 4 1:0,16:0,16:64
"""
import statistics, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
from sloserve.kernels import Kernels, _SIGS
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path
sig = _SIGS.pop("sl_x16_layer_tail")
old = Kernels("/tmp/w/lib_start.so", "avx512")
_SIGS["sl_x16_layer_tail"] = sig
new = Kernels("/tmp/w/lib_now.so", "avx512")
for k in (old, new): k.set_num_threads(2)
arms = {"start": (old, False), "now": (new, True)}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
points = [tuple(int(v) for v in p.split(":")) for p in (sys.argv[2] if len(sys.argv) > 2 else "1:0,4:0,16:0,16:64,16:256,0:512").split(",")]
best = {}
for r in range(rounds):
    for p in points:
        for name, (k, fused) in arms.items():
            fp.k, fp.fused_layers = k, fused
            s = time_mixed_steps(eng, p[0], 256, p[1], warmup=2, repeats=5)
            best.setdefault((p, name), []).append(statistics.median(x.wall_s for x in s) * 1e3)
for p in points:
    a, b = best[p, "start"], best[p, "now"]
    print(f"B={p[0]:3d} C={p[1]:4d} start {min(a):7.2f} (med {statistics.median(a):7.2f})  now {min(b):7.2f} (med {statistics.median(b):7.2f})  now/start {min(b)/min(a):.3f} (med {statistics.median(b)/statistics.median(a):.3f})")
