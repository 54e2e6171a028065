"""Decode step time by KV cache dtype: B requests decoding at a context of ~L tokens, the whole
engine step and the decode attention kernel's share of it, for each ``--kv-cache-dtype``.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--points 16x280,16x2000,4x4000,1x4000]
        [--kv-cache-dtypes auto,int8] [--steps 15] [--model FILE.gguf]

Each point prefills its B prompts untimed, steps 3 times, then times ``--steps`` decode steps,
all B requests decoding (checked): the median step, and the mean time per step inside
``Kernels.paged_attn_decode`` (0 where the engine does not run the project's decode kernel).
One engine per dtype, built one after the other in this process.
"""
from __future__ import annotations

import argparse
import statistics
import time

from sloserve.engine.llm import LLM
from sloserve.kernels import Kernels
from sloserve.tools.step_profile import start_decodes


def extra_tokens(batch: int, context: int, steps: int) -> int:
    """Output tokens per request: the prefill steps of the others (at most 512 tokens each),
    the warm-up and timed steps, a margin."""
    return -(-batch * context // 256) + steps + 8


def measure(eng, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(median step ms, mean decode-attention ms per step) of ``steps`` decode steps."""
    spent = [0.0]
    real = Kernels.paged_attn_decode

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = real(self, *a, **kw)
        spent[0] += time.perf_counter() - t
        return out
    # the first requests decode while the later ones prefill: enough tokens for all to be
    # decoding through the timed steps (contexts then spread over ~batch * context / budget)
    ids = start_decodes(eng, batch, context, extra_tokens(batch, context, steps))
    for _ in range(3):
        eng.step()
    # timed on the class, so whichever layer holds the kernels' instance goes through it
    Kernels.paged_attn_decode = timed
    walls = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
    finally:
        Kernels.paged_attn_decode = real
    if len(eng.scheduler.running) != batch:
        raise RuntimeError(f"{len(eng.scheduler.running)} requests decoding, not {batch}")
    for i in ids:
        eng.abort_request(i)
    return statistics.median(walls) * 1e3, spent[0] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--points", default="16x280,16x2000,4x4000,1x4000")
    ap.add_argument("--kv-cache-dtypes", default="auto,int8")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded model)")
    a = ap.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
    need = max(b * (c + extra_tokens(b, c, a.steps) + 16) for b, c in points)
    rows = {}
    for kv in a.kv_cache_dtypes.split(","):
        eng = LLM(a.model, kv_cache_dtype=kv, num_kv_blocks=-(-need // 16) + 16).engine
        name = f"{kv} ({eng.dtype_choice.kv_cache_dtype})"
        rows[name] = [measure(eng, b, c, a.steps) for b, c in points]
        del eng
    print(f"| KV cache | " + " | ".join(f"B={b}, ctx {c}: step / attention ms" for b, c in points) + " |")
    print("|---|" + "---:|" * len(points))
    for name, r in rows.items():
        print(f"| {name} | " + " | ".join(f"{s:.1f} / {at:.1f}" for s, at in r) + " |")


if __name__ == "__main__":
    main()
