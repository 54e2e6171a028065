"""The x16 int8-activation product alone on random weights (3072 x 576 and 576 x 1536, 4- and
8-bit): best of 15 per row count, GOP/s, error against the float product. Arg 1: row counts;
arg 2 (optional): save the outputs (to compare two builds bit for bit).

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/x16_rates.py 1,4,8,16,64,256,512
"""
import sys, time, torch
from sloserve.kernels import load
from sloserve.model.quant import QuantizedWeight
torch.manual_seed(0)
k = load()
def mk(N, K, bits=4):
    if bits == 4:
        qw = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8)
        mins = torch.randn(N, K // 32) * 0.01
    else:
        qw = torch.randint(-127, 128, (N, K), dtype=torch.int8); mins = None
    return QuantizedWeight(qw, torch.rand(N, K // 32) * 0.01, mins, bits, 32, (N, K), "t")
res = {}
for bits in (4, 8):
  for (N, K) in ((3072, 576), (576, 1536)):
    w = mk(N, K, bits); p = k.pack_x16(w); wd = w.dequantize()
    for M in [int(s) for s in sys.argv[1].split(",")]:
        x = torch.randn(M, K)
        y = k.qlinear_x16(x, p)
        err = ((y - x @ wd.T).abs().max() / (x @ wd.T).abs().max()).item()
        t = 1e9
        for _ in range(15):
            t0 = time.perf_counter(); k.qlinear_x16(x, p); t = min(t, time.perf_counter() - t0)
        res[(bits, N, K, M)] = y
        print(f"bits {bits} N={N:5d} K={K:5d} M={M:4d} {t*1e3:7.3f} ms {2*M*N*K/t/1e9:6.0f} GOP/s relerr {err:.2e}")
torch.save(res, sys.argv[2]) if len(sys.argv) > 2 else None
