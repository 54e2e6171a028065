"""Where a step's forward time goes: every Kernels method wrapped with a timer, the rest of the
forward (torch's GEMMs, mostly) by difference. As run: 16 decodes at context ~256 plus a
256-token chunk at position 0 (20 separate steps after 3 warm-up ones); edit M, C for other
points (C = 0: decode steps only).

    .venv/bin/python benchmarks/results/zen5_2026-12-05/step_kernel_times.py
"""
import time, statistics, collections, torch
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path
k = fp.k
acc = collections.defaultdict(float); cnt = collections.Counter()
names = [n for n in dir(k) if not n.startswith("_") and callable(getattr(k, n)) and n not in ("set_num_threads",)]
for n in names:
    f = getattr(k, n)
    def w(*a, _f=f, _n=n, **kw):
        t = time.perf_counter(); r = _f(*a, **kw); acc[_n] += time.perf_counter() - t; cnt[_n] += 1; return r
    setattr(k, n, w)
for M, C in ((16, 256),):
    time_mixed_steps(eng, M, 256, C, warmup=3, repeats=3)
    acc.clear(); cnt.clear()
    s = [x for _ in range(20) for x in time_mixed_steps(eng, M, 256, C, warmup=0, repeats=1)]
    fw = sum(x.forward_s for x in s) / 20 * 1e3
    tot = sum(acc.values()) / 20 * 1e3
    print(f"M={M}: forward {fw:.2f} ms/step, in kernel wrappers {tot:.2f}, outside {fw - tot:.2f}")
    for n, v in sorted(acc.items(), key=lambda x: -x[1]):
        print(f"   {n}: {v/20*1e3:.2f} ms ({cnt[n]//20} calls)")
