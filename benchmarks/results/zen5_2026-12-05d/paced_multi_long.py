"""A breaker helper's check of prefill pacing with several long prompts: 4 short requests
decoding, then N prompts of 640 tokens, offline on 1 thread, pacing on or off:

    .venv/bin/python benchmarks/results/zen5_2026-12-05d/paced_multi_long.py on 8 150
    .venv/bin/python benchmarks/results/zen5_2026-12-05d/paced_multi_long.py off 8 150
"""
import sys, time, statistics
from sloserve import LLM
from sloserve.sampling_params import SamplingParams
pacing = sys.argv[1] == "on"
NL = int(sys.argv[2]); SHORT_MT = int(sys.argv[3])
import os
llm = LLM(dtype=os.environ.get("DT","auto"), enable_prefill_pacing=pacing, num_threads=1, seed=0, enable_prefix_caching=False, **({"num_kv_blocks": int(sys.argv[4])} if len(sys.argv)>4 else {}))
tok = llm.tokenizer
eng = llm.engine; core = eng.core; sch = core.scheduler
# warm up rates: one short decode and one prefill
llm.generate([tok.encode("hello there " * 300)[:600], tok.encode("hi")], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
shorts = [tok.encode(f"Question {i}: what is {i} plus {i*3}? Answer:") for i in range(4)]
longs = [tok.encode(f"Story number {j}. " + "Once upon a time in a land far away there lived " * 60)[:640] for j in range(NL)]
reqs = [eng.make_request(p, SamplingParams(temperature=0, max_tokens=SHORT_MT, ignore_eos=True)) for p in shorts]
lreqs = [eng.make_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for p in longs]
for r in reqs: eng.add(r)
t0 = time.monotonic()
toks = {}; fin = {}; first = {}; steps = []; maxpre = 0
eng.step(); eng.step()
for r in lreqs: eng.add(r)
ta = time.monotonic()
while eng.has_unfinished_requests():
    t = time.monotonic()
    outs = eng.step()
    dt = time.monotonic() - t
    pre = sum(1 for r in sch.running if r.num_computed_tokens < r.num_prompt_tokens)
    maxpre = max(maxpre, pre)
    nd = sum(1 for r in sch.running if r.num_output_tokens > 0)
    steps.append((dt, nd if pre else 0))
    for o in outs:
        if o.token_ids and o.request_id not in first: first[o.request_id] = time.monotonic()
        if o.finished: fin[o.request_id] = time.monotonic(); toks[o.request_id] = o.token_ids
st = [(fin[r.request_id]-t0)/SHORT_MT*1e3 for r in reqs]
print('short mean TPOT (incl. first) ms', [round(x,1) for x in st])
lt = [first[r.request_id] - ta for r in lreqs]
dec_steps = [d for d, nd in steps if nd]
print(f"pacing={pacing} long TTFT mean {statistics.mean(lt):.2f}s max {max(lt):.2f}s  max concurrent prefills {maxpre}  "
      f"steps with decodes: n={len(dec_steps)} median {statistics.median(dec_steps)*1e3:.0f}ms p90 {sorted(dec_steps)[int(.9*len(dec_steps))]*1e3:.0f}ms decode-only d={core.rates.decode_step_s*1e3:.1f}ms max {max(dec_steps)*1e3:.0f}ms  total {time.monotonic()-ta:.2f}s  pace={sch.paced_prefill_tokens} preemptions={sch.num_preemptions}")

import json; json.dump({r.request_id.split("-")[-1] if False else i: list(sch_out) for i,(r,sch_out) in enumerate([])}, open("/dev/null","w"))

print("TOKENS", [toks[r.request_id] for r in reqs + lreqs])
