"""Paged decode attention alone: 30 layers' caches [2, NB, bs, Hkv, D] bf16, B=16 at ctx (arg 1),
block tables shuffled; cold (each layer's cache once per round, ~97 MB at ctx 256) vs "hot"
(the first NC caches (arg 2) repeated: 1 fits the two cores' L2, 3 the L3).

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/decode_attn_micro.py 256 1
"""
import time, torch, sys
from sloserve.kernels import load
k = load()
NC = int(sys.argv[2]) if len(sys.argv) > 2 else 1
B, ctx, bs, Hkv, H, D, L = 16, int(sys.argv[1]) if len(sys.argv) > 1 else 256, 16, 3, 9, 64, 30
per = -(-ctx // bs); NB = B * per + 8
caches = [torch.randn(2, NB, bs, Hkv, D).to(torch.bfloat16) for _ in range(L)]
g = torch.Generator().manual_seed(0)
bt = torch.randperm(NB, generator=g)[:B * per].view(B, per).contiguous()
sl = torch.full((B,), ctx, dtype=torch.int64)
q = torch.randn(B, H, D)
def run(cs):
    for c in cs: k.paged_attn_decode(q, c, bt, sl, ctx, 0.125, 256)
for _ in range(3): run(caches)
cold = hot = 1e9
for _ in range(10):
    t0 = time.perf_counter(); run(caches); t1 = time.perf_counter(); run(caches[:NC] * (L // NC)); t2 = time.perf_counter()
    cold, hot = min(cold, t1 - t0), min(hot, t2 - t1)
kvb = B * ctx * Hkv * D * 2 * 2 * L
print(f"ctx {ctx}: cold {cold*1e3:.2f} ms ({kvb/cold/1e9:.1f} GB/s), hot {hot*1e3:.2f} ms ({kvb/hot/1e9:.1f} GB/s)")
