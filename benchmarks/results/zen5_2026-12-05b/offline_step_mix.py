"""The c=16 workload offline (48 random prompts of 256 tokens, 64 out, greedy, ignore_eos,
max_num_seqs 16): wall, tok/s, and the runner's steps grouped by kind (decode-only, with a
prefill chunk of <= 128 or more tokens) with their time.

    .venv/bin/python benchmarks/results/zen5_2026-12-05b/offline_step_mix.py
"""
import time, collections, random
from sloserve import LLM, SamplingParams
llm = LLM(max_num_seqs=16)
eng = llm.engine
rec = []
ex = eng.runner.execute
def wrap(so):
    t = time.perf_counter(); r = ex(so); w = time.perf_counter() - t
    dec = sum(1 for s in so.scheduled if s.is_decode) if hasattr(so, "scheduled") else -1
    toks = sum(s.num_new_tokens for s in so.scheduled) if hasattr(so, "scheduled") else -1
    rec.append((toks, dec, w, r.forward_s)); return r
eng.runner.execute = wrap
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(256)] for _ in range(48)]
sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
llm.generate([prompts[0][:10]], sp)
rec.clear()
t0 = time.perf_counter(); outs = llm.generate(prompts, sp); wall = time.perf_counter() - t0
n = sum(o.num_output_tokens for o in outs)
ex_t = sum(r[2] for r in rec); fw = sum(r[3] for r in rec)
print(f"wall {wall:.2f} s, {n/wall:.0f} tok/s, steps {len(rec)}, execute {ex_t:.2f} s, forward {fw:.2f} s, outside execute {wall-ex_t:.2f} s")
b = collections.defaultdict(lambda: [0, 0.0, 0])
for toks, dec, w, f in rec:
    k = "decode-only" if toks == dec else ("prefill<=128" if toks - dec <= 128 else "prefill>128")
    b[k][0] += 1; b[k][1] += w; b[k][2] += toks
for k, (c, w, t) in b.items():
    print(f"{k}: {c} steps, {w:.2f} s, avg {w/c*1e3:.1f} ms, avg tokens {t/c:.0f}")
