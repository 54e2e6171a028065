"""Weights and KV cache on 2 MB pages (madvise MADV_HUGEPAGE before first touch) vs as allocated,
alternated in one process (copies of both). Run at 5a8f194 (before sloserve/model/hugepages.py:
after it both arms are on 2 MB pages). Points B:C[:ctx].

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/step_ab_hugepages.py 4 1:0,16:0,16:0:1024
"""
import ctypes, dataclasses, statistics, sys, torch
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
from sloserve.kernels import X16Weight
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
keep = []
def huge_like(t):
    nbytes = t.numel() * t.element_size()
    buf = torch.empty(nbytes + (4 << 20), dtype=torch.uint8)
    p = buf.data_ptr(); a = (p + (2 << 20) - 1) & ~((2 << 20) - 1)
    assert libc.madvise(a, (nbytes + (2 << 20) - 1) & ~((2 << 20) - 1), 14) == 0
    out = buf[a - p:a - p + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t); keep.append(buf)
    return out
def huge_w(w):
    if not isinstance(w, X16Weight): return w
    qw, d = huge_like(w.qweight), huge_like(w.scales)
    mn = huge_like(w.mins) if w.mins is not None else None
    return dataclasses.replace(w, qweight=qw, scales=d, mins=mn, ptrs=(qw.data_ptr(), d.data_ptr(), mn.data_ptr() if mn is not None else None))
eng = LLM(max_num_batched_tokens=4096).engine
fp, r = eng.runner.fast_path, eng.runner
names = ("qkv", "o", "gate_up", "down")
orig = {"layers": [{n: getattr(L, n) for n in names} for L in fp.layers], "lm": fp.lm_q, "kv": r.kv_caches}
thp = {"layers": [{"qkv": [huge_w(w) for w in L.qkv], "o": huge_w(L.o), "gate_up": [huge_w(w) for w in L.gate_up], "down": huge_w(L.down)} for L in fp.layers],
       "lm": huge_w(fp.lm_q), "kv": [huge_like(c) for c in r.kv_caches]}
print("AnonHugePages:", [l for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l][0].strip())
def use(arm):
    for L, ws in zip(fp.layers, arm["layers"]):
        for n, w in ws.items(): setattr(L, n, w)
    fp.lm_q = arm["lm"]; r.kv_caches = arm["kv"]
points = [tuple(int(v) for v in p.split(":")) for p in sys.argv[2].split(",")]
best = {}
for rnd in range(int(sys.argv[1])):
    for p in points:
        for name, arm in (("4k", orig), ("thp", thp)):
            use(arm)
            s = time_mixed_steps(eng, p[0], p[2] if len(p) > 2 else 256, p[1], warmup=2, repeats=5)
            best.setdefault((p, name), []).append(statistics.median(x.wall_s for x in s) * 1e3)
for p in points:
    a, b = best[p, "4k"], best[p, "thp"]
    print(f"B={p[0]:3d} C={p[1]:4d} ctx={p[2] if len(p) > 2 else 256} 4k {min(a):6.2f} (med {statistics.median(a):6.2f})  thp {min(b):6.2f} (med {statistics.median(b):6.2f})  ratio {min(b)/min(a):.3f}")
