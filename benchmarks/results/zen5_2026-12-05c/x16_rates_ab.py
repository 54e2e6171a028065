"""The x16 product alone, hot (best of 60, 2 threads), for several kernel libraries alternated in
one process, and whether their outputs are bit-identical. Libraries: /tmp/w/lib_<name>.so, built
with build_variant.sh (e.g. from `git show REV:sloserve/kernels/csrc/kernels.cpp`).

    .venv/bin/python benchmarks/results/zen5_2026-12-05c/x16_rates_ab.py old,new 1,16,64
"""
import sys, time, torch
from sloserve.kernels import Kernels
from sloserve.model.quant import QuantizedWeight
torch.manual_seed(0)
libs = sys.argv[1].split(",")
ks = [Kernels(f"/tmp/w/lib_{l}.so", "avx512") for l in libs]
for k in ks: k.set_num_threads(2)
def mk(N, K, bits=4):
    if bits == 4:
        qw = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8); mins = torch.randn(N, K // 32) * 0.01
    else:
        qw = torch.randint(-127, 128, (N, K), dtype=torch.int8); mins = None
    return QuantizedWeight(qw, torch.rand(N, K // 32) * 0.01, mins, bits, 32, (N, K), "t")
shapes = [(576, 576, 4), (960, 576, 4), (576, 1536, 4), (3072, 576, 4), (49152, 576, 8)]
Ms = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "1,16,64").split(",")]
for (N, K, bits) in shapes:
    w = mk(N, K, bits); ps = [k.pack_x16(w) for k in ks]
    for M in Ms:
        x = torch.randn(M, K)
        ys = [k.qlinear_x16(x, p) for k, p in zip(ks, ps)]
        same = all(torch.equal(ys[0], y) for y in ys)
        ts = [1e9] * len(ks)
        for r in range(60):
            for i, (k, p) in enumerate(zip(ks, ps)):
                t0 = time.perf_counter(); k.qlinear_x16(x, p); ts[i] = min(ts[i], time.perf_counter() - t0)
        print(f"N={N:5d} K={K:5d} b{bits} M={M:4d} " + "  ".join(f"{l}: {t*1e6:7.1f} us {2*M*N*K/t/1e9:5.0f} GOP/s" for l, t in zip(libs, ts)), "same" if same else "DIFF")
