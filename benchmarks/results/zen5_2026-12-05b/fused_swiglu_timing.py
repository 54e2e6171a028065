"""The gate/up product with SiLU * up in its epilogue vs the plain product then silu_mul
(random 3072 x 576 weights, int4 and int8): asserts they are bit-identical, prints best of 10.

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/fused_swiglu_timing.py
"""
import torch, time
from sloserve.kernels import load
from sloserve.model.quant import quantize_int4, quantize_int8
k = load()
for q in (quantize_int4, quantize_int8):
    w = q(torch.randn(3072, 576), "t")
    p = k.pack_x16(w); s = k.pack_x16_swiglu(w)
    for M in (1, 5, 16, 17, 100, 512):
        x = torch.randn(M, 576)
        ref = k.silu_mul(k.qlinear_x16(x, p)); y = k.qlinear_x16_swiglu(x, s)
        assert torch.equal(ref, y), (M, (ref - y).abs().max())
        ta = tb = 1e9
        for _ in range(10):
            t0 = time.perf_counter(); k.silu_mul(k.qlinear_x16(x, p)); t1 = time.perf_counter(); k.qlinear_x16_swiglu(x, s); t2 = time.perf_counter()
            ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
        print(q.__name__, M, f"separate {ta*1e3:.3f} ms fused {tb*1e3:.3f} ms")
