"""The AMX prefill attention alone, 30 layers of the embedded model's heads (9 query, 3 KV, d 64) over a
random bf16 paged cache: ms per step and TFLOP/s of causal attention (2026-12-04).

    .venv/bin/python benchmarks/results/levers_2026-12-04/prefill_attn_timing.py
"""
import torch, time, sys
import sloserve.kernels as K
k = K.load(); assert k.amx
H, Hkv, D, bs = 9, 3, 64, 16
def bench(n, P, reps=20):
    ctx = n + P
    nb = -(-ctx // bs) + 4
    cache = torch.randn(2, nb, bs, Hkv, D).to(torch.bfloat16)
    blocks = torch.randperm(nb)[:-(-ctx // bs)].to(torch.int64).contiguous()
    q = torch.randn(n, H, D)
    for _ in range(3): k.amx_prefill_attn(q, cache, blocks, P, D ** -0.5)
    t = time.perf_counter()
    for _ in range(reps): k.amx_prefill_attn(q, cache, blocks, P, D ** -0.5)
    dt = (time.perf_counter() - t) / reps
    # causal flops: QK and PV, 2 flops per MAC
    pairs = sum(P + i + 1 for i in range(n))
    fl = 4 * H * D * pairs
    return dt, fl
for n, P in [(128, 0), (256, 0), (496, 0), (512, 1536)]:
    dt, fl = bench(n, P)
    print(f"n={n} P={P}: {dt*1e3:.3f} ms/layer  x30 = {dt*30e3:.1f} ms  {fl/dt/1e12:.3f} TFLOP/s (causal flops)")
