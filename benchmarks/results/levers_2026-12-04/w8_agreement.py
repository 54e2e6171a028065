"""Greedy agreement with int8 per-output-channel weights in the dense steps of up to 32 tokens
(above the quantized crossover), emulated in torch (2026-12-04; not in the engine).

    .venv/bin/python benchmarks/results/levers_2026-12-04/w8_agreement.py none pc colmax sqrtcol

none: the emulation's float32 product of the bf16 weights (no rounding); pc: int8 per output
channel; colmax / sqrtcol: input channels equalized by their max (or its square root) first.
"""
import statistics, torch, sys, types
sys.path.insert(0, "benchmarks")
from kv_int8_agreement import PROMPTS, first_difference
from sloserve import LLM, SamplingParams
import torch.nn.functional as F
sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
def fq(w, mode):
    w = w.float()
    if mode == "none": return w
    s = {"pc": lambda: torch.ones(w.shape[1]), "colmax": lambda: w.abs().amax(0).clamp_min(1e-8),
         "sqrtcol": lambda: w.abs().amax(0).clamp_min(1e-8).sqrt()}[mode]()
    ws = w / s; r = ws.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    return (torch.round(ws / r).clamp(-127, 127) * r) * s
def run(mode):
    llm = LLM(dtype="bfloat16"); tok = llm.tokenizer
    fp = llm.engine.runner.fast_path
    calls = [0]
    if mode != "base":
        cache = {}
        def W(w):
            if id(w) not in cache: cache[id(w)] = fq(w, mode)
            return cache[id(w)]
        od, osw = fp._d, fp._swiglu
        def d(x, w, out_dtype=torch.float32):
            if x.shape[0] <= 32:
                calls[0] += 1
                return (x.float().to(torch.bfloat16).float() @ W(w).T).to(out_dtype)
            return od(x, w, out_dtype)
        def sw(x, L, act):
            if x.shape[0] <= 32:
                g, u = (x.float().to(torch.bfloat16).float() @ W(L.dense["gate_up"]).T).chunk(2, dim=1)
                return F.silu(g) * u
            return osw(x, L, act)
        fp._d, fp._swiglu = d, sw
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    o = [list(x.token_ids) for x in llm.generate(ids, sp)]
    print(mode, "quant_max", fp.quant_max_tokens, "emulated calls", calls[0], flush=True)
    return o
base = run("base")
for m in sys.argv[1:]:
    fd = [first_difference(x, y) for x, y in zip(run(m), base)]
    print(m, ":", sum(f == 48 for f in fd), "/16 agree;", fd, "median", statistics.median(fd), flush=True)
