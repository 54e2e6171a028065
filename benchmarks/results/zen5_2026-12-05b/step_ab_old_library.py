"""Step times with two kernel libraries in one process, alternated: the library built from the
previous kernels.cpp (/tmp/w/old.so; quantized steps up to 32 tokens as its race chose) vs the
current one (its measured crossover). Build the old one first, e.g.
    git show 20889b9:sloserve/kernels/csrc/kernels.cpp > /tmp/w/kernels_orig.cpp
    g++ -O3 -std=c++17 -pthread -fPIC -shared -fno-math-errno -ffp-contract=off -fopenmp \
        -DSL_USE_OMP -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -mavx2 \
        /tmp/w/kernels_orig.cpp -o /tmp/w/old.so
    .venv/bin/python benchmarks/results/zen5_2026-12-05b/step_ab_old_library.py 3
(Only for kernels whose C signatures and weight layouts both libraries share: run at 3cb6ac5.)
"""
import statistics, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
from sloserve.kernels import Kernels
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path
k_new = fp.k
k_old = Kernels("/tmp/w/old.so", "avx512")
arms = {"old": (k_old, 32), "new": (k_new, fp.quant_max_tokens)}
print("new quant_max_tokens", fp.quant_max_tokens)
points = [(0, 64), (0, 256), (0, 512), (16, 0), (16, 64), (16, 256), (16, 512)]
best = {}
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for p in points:
        for name, (k, qm) in arms.items():
            fp.k, fp.quant_max_tokens = k, qm
            s = time_mixed_steps(eng, p[0], 256, p[1], warmup=2, repeats=5)
            ms = statistics.median(x.wall_s for x in s) * 1e3
            best[p, name] = min(best.get((p, name), 1e9), ms)
for p in points:
    print(f"B={p[0]:3d} C={p[1]:4d}  old {best[p,'old']:7.1f} ms  new {best[p,'new']:7.1f} ms  new/old {best[p,'new']/best[p,'old']:.2f}")
