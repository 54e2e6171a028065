"""The bf16 prefill attention kernel (on this CPU's ISA: AMX or AVX512-BF16) against the path it
replaces where AMX is absent (torch's CPU flash attention in bf16 as cpu-paged called it before:
the context gathered, two flash calls merged by log-sum-exp), 30 layers of the embedded model's
heads (9 query, 3 KV, d 64) over a random bf16 paged cache. The two alternated, best of 5 rounds.

    .venv/bin/python benchmarks/results/zen5_2026-12-05/prefill_attn_timing.py
"""
import time

import torch

import sloserve.kernels as K
from sloserve.model.attention.torch_ref import MultiQuery, _multi

k = K.load()
H, Hkv, D, bs = 9, 3, 64, 16
print(f"kernel isa: {k.prefill_attn_isa}; torch threads {torch.get_num_threads()}")


def timed(f, reps):
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


for n, P in [(64, 192), (128, 0), (256, 0), (512, 0), (512, 512), (512, 1536)]:
    ctx = n + P
    nb = -(-ctx // bs) + 4
    cache = torch.randn(2, nb, bs, Hkv, D).to(torch.bfloat16)
    blocks = torch.randperm(nb)[:-(-ctx // bs)].to(torch.int64).contiguous()
    q = torch.randn(n, H, D)
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[P:ctx]
    kn = cache[0].reshape(-1, Hkv, D)[slots]
    vn = cache[1].reshape(-1, Hkv, D)[slots]
    mq = MultiQuery(0, n, P, blocks if P else None)
    kern = lambda: k.prefill_attn(q, cache, blocks, P, D ** -0.5)  # noqa: E731
    ref = lambda: _multi(q.bfloat16(), kn, vn, cache[0], cache[1], mq, D ** -0.5)  # noqa: E731
    err = (kern() - ref().float()).abs().max().item()
    reps = max(2, int(2000 // ctx))
    best = [float("inf")] * 2
    for _ in range(5):
        for i, f in enumerate((kern, ref)):
            best[i] = min(best[i], timed(f, reps))
    fl = 4 * H * D * sum(P + i + 1 for i in range(n))  # causal: QK and PV, 2 flop per MAC
    print(f"n={n:4d} P={P:5d}: kernel {best[0] * 30e3:7.1f} ms x30 ({fl / best[0] / 1e9:5.0f} "
          f"GFLOP/s), torch {best[1] * 30e3:7.1f} ms x30, {best[1] / best[0]:4.2f}x; max |diff| {err:.4f}")
