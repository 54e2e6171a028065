"""A 2,048-token prompt prefilled in four 512-token chunk steps beside 2 decodes (what the
compare harness's long requests do): step times and the kernels' share, two rounds.

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/long_prefill_prof.py
"""
import time, collections, torch
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
fp = eng.runner.fast_path; k = fp.k
acc = collections.defaultdict(float); cnt = collections.Counter()
for n in [n for n in dir(k) if not n.startswith("_") and callable(getattr(k, n)) and n != "set_num_threads"]:
    f = getattr(k, n)
    def w(*a, _f=f, _n=n, **kw):
        t = time.perf_counter(); r = _f(*a, **kw); acc[_n] += time.perf_counter() - t; cnt[_n] += 1; return r
    setattr(k, n, w)
time_mixed_steps(eng, 2, 256, 512, warmup=0, repeats=4)
for rnd in range(2):
    acc.clear(); cnt.clear()
    s = time_mixed_steps(eng, 2, 256, 512, warmup=0, repeats=4)
    print("steps (chunk at 0, 512, 1024, 1536 + 2 decodes):", ["%.0f" % (x.wall_s * 1e3) for x in s], "ms; sum %.0f" % (sum(x.wall_s for x in s) * 1e3))
    for n, v in sorted(acc.items(), key=lambda x: -x[1])[:6]:
        print(f"   {n}: {v*1e3:.1f} ms ({cnt[n]} calls)")
