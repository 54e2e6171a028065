"""A 2,048-token prompt prefilled beside 2 decodes in chunks of 8-512 tokens: the steps' sum, and
what a request decoding for 63 steps beside it pays (its TPOT over those steps), two rounds.

    .venv/bin/python benchmarks/results/zen5_2026-12-05d/pace_chunks.py
"""
import time, sys
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
time_mixed_steps(eng, 2, 256, 512, warmup=0, repeats=4)
for rnd in range(2):
    s = time_mixed_steps(eng, 2, 256, 0, warmup=2, repeats=40)
    d = sorted(x.wall_s for x in s)[len(s)//2]*1e3
    print(f"round {rnd}: 2 decodes alone: median {d:.2f} ms")
    for chunk in [8, 16, 24, 32, 64, 128, 512]:
        s = time_mixed_steps(eng, 2, 256, chunk, warmup=0, repeats=2048 // chunk)
        w = [x.wall_s*1e3 for x in s]
        print(f"  chunk {chunk:4d}: {len(w)} steps, sum {sum(w):.0f} ms, mean {sum(w)/len(w):.2f}, first {w[0]:.2f} last {w[-1]:.2f}; "
              f"prefill share over 63 steps: {sum(w[:63]):.0f} ms -> short TPOT {(sum(w[:63]) if len(w)>=63 else sum(w)+ (63-len(w))*d)/63:.2f}")
