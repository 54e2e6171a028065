"""The quantized (x16) products of a step by weight shape, in the engine: ms per step, us per
call, GOP/s and weight GB/s. Args: decodes B, chunk C (0: decode steps only).

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/decode_products_by_shape.py 16 0
"""
import time, collections, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path
k = fp.k
acc = collections.defaultdict(float); cnt = collections.Counter()
f = k.qlinear_x16
def w(x, wt, _f=f):
    t = time.perf_counter(); r = _f(x, wt); key = (x.shape[0], wt.shape[0], wt.shape[1], wt.bits)
    acc[key] += time.perf_counter() - t; cnt[key] += 1; return r
k.qlinear_x16 = w
M, C = int(sys.argv[1]), int(sys.argv[2])
time_mixed_steps(eng, M, 256, C, warmup=3, repeats=3)
acc.clear(); cnt.clear()
for _ in range(20): time_mixed_steps(eng, M, 256, C, warmup=0, repeats=1)
for key, v in sorted(acc.items(), key=lambda x: -x[1]):
    m, n, kk, b = key
    us = v / cnt[key] * 1e6
    wb = n * kk * b / 8 + n * kk / 32 * 8
    print(f"M={m} N={n} K={kk} bits={b}: {v/20*1e3:.2f} ms/step, {us:.1f} us/call, {2*m*n*kk/us/1e3:.0f} GOP/s, {wb/us/1e3:.1f} GB/s weights")
