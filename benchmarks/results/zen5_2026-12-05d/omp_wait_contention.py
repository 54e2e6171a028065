"""Step times with a CPU burner on one of the two cores (what the bench client does when it
finishes), under libgomp's wait policies: run once per setting, e.g.

    for env in "" GOMP_SPINCOUNT=10000 GOMP_SPINCOUNT=1000 OMP_WAIT_POLICY=passive; do
      env $env .venv/bin/python benchmarks/results/zen5_2026-12-05d/omp_wait_contention.py; done
"""
import sys, subprocess, time, statistics
from sloserve.engine.llm import LLM
from sloserve.engine.step_profile import time_mixed_steps
eng = LLM(max_num_batched_tokens=4096).engine
time_mixed_steps(eng, 2, 256, 0, warmup=2, repeats=20)
def run(label):
    for batch, chunk in [(2, 0), (16, 0), (2, 64)]:
        s = [x.wall_s*1e3 for x in time_mixed_steps(eng, batch, 256, chunk, warmup=2, repeats=60)]
        s.sort()
        print(f"  {label} B={batch} chunk={chunk}: median {s[len(s)//2]:.2f} p90 {s[int(.9*len(s))]:.2f} max {s[-1]:.2f} mean {statistics.mean(s):.2f}", flush=True)
run("quiet")
p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
time.sleep(0.5)
run("1 burner")
p.kill()
run("quiet again")
