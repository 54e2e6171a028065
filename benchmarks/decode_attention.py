"""The decode attention kernel alone (``Kernels.paged_attn_decode``): the rate it reads a paged KV
cache at, per shape and cache dtype, from memory as a decode step reads it.

    .venv/bin/python benchmarks/decode_attention.py [--points 16x1024x32x8x64,...]
        [--kv-cache-dtypes bf16,int8] [--layers 8] [--rounds 6]

A point ``BxCTXxHxHKVxD``: B requests at a context of CTX tokens, H query heads over HKV KV
heads of D values. Each dtype gets ``--layers`` caches of the engine's own allocation (2 MB
pages), filled at random, blocks of 16 tokens in a shuffled block table (so that a step reads
them from memory, not the last-level cache); the dtypes are timed in turns, ``--rounds`` times,
and the median per layer is reported with the bytes it read per second (int8: codes and
scales, ``D + 4`` bytes an entry). The default points are the 1B (64 x 32 heads / 8) and
3B / 8B (128 x 24 or 32 / 8) Llama shapes at 16 requests x 1,024 and 4,096 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sloserve import kernels
from sloserve.model import hugepages
from sloserve.model.attention import kv_int8

BLOCK = 16
DEFAULT_POINTS = "16x1024x32x8x64,16x1024x24x8x128,16x1024x32x8x128,16x4096x32x8x128,1x4096x32x8x128"


def make(point, dtype: str, layers: int, gen: torch.Generator):
    """(caches, block table, sequence lengths, q, bytes read per layer) for one point."""
    b, ctx, h, hkv, d = point
    per_req = -(-ctx // BLOCK)
    nb = b * per_req + 1
    caches = []
    for _ in range(layers):
        x = torch.randn(2, nb, BLOCK, hkv, d, generator=gen)
        e = kv_int8.quantize(x) if dtype == "int8" else x.to(torch.bfloat16)
        c = hugepages.zeros(tuple(e.shape), e.dtype)
        c.copy_(e)
        caches.append(c)
    table = (torch.randperm(nb - 1, generator=gen)[:b * per_req].view(b, per_req) + 1).contiguous()
    entry = d + 4 if dtype == "int8" else 2 * d
    return (caches, table, torch.full((b,), ctx, dtype=torch.long),
            torch.randn(b, h, d, generator=gen), 2 * b * ctx * hkv * entry)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=DEFAULT_POINTS)
    ap.add_argument("--kv-cache-dtypes", default="bf16,int8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    k = kernels.load()
    if k is None:
        raise SystemExit("decode_attention: the CPU kernels do not load here")
    dtypes = a.kv_cache_dtypes.split(",")
    gen = torch.Generator().manual_seed(0)
    print(f"kernels {k.variant}, {torch.get_num_threads()} threads, {a.layers} layers per dtype, "
          f"median of {a.rounds} rounds")
    print("| B x ctx, heads / KV heads, D | " + " | ".join(f"{t}: ms per layer, GB/s" for t in dtypes)
          + (" | int8 / bf16 time |" if {"bf16", "int8"} <= set(dtypes) else " |"))
    print("|---|" + "---:|" * (len(dtypes) + ({"bf16", "int8"} <= set(dtypes))))
    for p in a.points.split(","):
        point = tuple(int(x) for x in p.split("x"))
        b, ctx, h, hkv, d = point
        sets = {t: make(point, t, a.layers, gen) for t in dtypes}
        times = {t: [] for t in dtypes}
        for _ in range(a.rounds):
            for t, (caches, table, lens, q, _) in sets.items():
                t0 = time.perf_counter()
                for c in caches:
                    k.paged_attn_decode(q, c, table, lens, ctx, d ** -0.5, 256)
                times[t].append((time.perf_counter() - t0) / len(caches))
        med = {t: statistics.median(v) for t, v in times.items()}
        cells = [f"{med[t] * 1e3:.2f}, {sets[t][4] / med[t] / 1e9:.1f}" for t in dtypes]
        ratio = (f" | {med['int8'] / med['bf16']:.2f}" if {"bf16", "int8"} <= set(dtypes) else "")
        print(f"| {b} x {ctx}, {h} / {hkv}, {d} | " + " | ".join(cells) + ratio + " |")
        del sets


if __name__ == "__main__":
    main()
