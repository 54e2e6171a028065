"""Paged decode attention inside the engine's decode steps: every paged_attn_decode call timed
(30 layers), 20 steps after 3 warm-up ones, at B=16 ctx 256 / 1024 and B=1 ctx 4,000; GB/s is
the bf16 K+V bytes read over that time.

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/decode_attn_in_engine.py
"""
import time, collections, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
k = eng.runner.fast_path.k
acc = [0.0]
f = k.paged_attn_decode
def w(*a, **kw):
    t = time.perf_counter(); r = f(*a, **kw); acc[0] += time.perf_counter() - t; return r
k.paged_attn_decode = w
for M, ctx in ((16, 256), (16, 1024), (1, 4000)):
    time_mixed_steps(eng, M, ctx, 0, warmup=3, repeats=3)
    acc[0] = 0
    s = time_mixed_steps(eng, M, ctx, 0, warmup=0, repeats=20)
    kvb = M * ctx * 30 * 2 * 3 * 64 * 2
    print(f"B={M} ctx={ctx}: attention {acc[0]/20*1e3:.2f} ms/step ({kvb/(acc[0]/20)/1e9:.1f} GB/s), step {sum(x.wall_s for x in s)/20*1e3:.2f} ms")
