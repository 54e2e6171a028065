"""torch's profiler over mixed steps of B decodes and a C-token chunk (what took the time of a
512-token chunk's steps before the AVX512-BF16 prefill attention, 2026-12-05).

    .venv/bin/python benchmarks/results/zen5_2026-12-05/prof.py B C [warm-up steps]
"""
import sys, torch, statistics
from torch.profiler import profile, ProfilerActivity
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
B, C = int(sys.argv[1]), int(sys.argv[2])
warm = int(sys.argv[3]) if len(sys.argv) > 3 else 3
s = time_mixed_steps(eng, B, 256, C, warmup=warm, repeats=1)
print("step ms", [round(x.wall_s*1e3,1) for x in s])
with profile(activities=[ProfilerActivity.CPU]) as p:
    time_mixed_steps(eng, B, 256, C, warmup=warm, repeats=1)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
