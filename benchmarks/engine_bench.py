"""Engine micro-benchmarks (issue 2): decode tokens/s at batch 1 and 16, one 512-token prefill,
and the share of a step spent outside the model forward at batch 16.

    .venv/bin/python benchmarks/engine_bench.py [--dtype bfloat16] [--model PATH] [--out FILE.json]

Each figure is the median over repeated steps of one process; the machine is noisy, so compare
figures from one run side by side rather than across runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.tools.step_profile import time_decode_steps, time_prefill_steps


def decode_rate(eng: LLMEngine, batch: int, context_len: int, steps: int) -> dict:
    """Median of `steps` pure-decode steps of `batch` sequences around `context_len`."""
    ss = time_decode_steps(eng, batch, context_len, warmup=2, repeats=steps)
    w = statistics.median(s.wall_s for s in ss)
    f = statistics.median(s.forward_s for s in ss)
    return {"batch": batch, "context_len": context_len, "step_ms": w * 1e3, "forward_ms": f * 1e3,
            "prepare_ms": statistics.median(s.prepare_s for s in ss) * 1e3,
            "sample_ms": statistics.median(s.sample_s for s in ss) * 1e3,
            "decode_tok_per_s": batch / w, "outside_forward_share": 1 - f / w}


def prefill_time(eng: LLMEngine, n: int, reps: int) -> dict:
    """Median of `reps` steps that each prefill one `n`-token prompt (after one warm-up)."""
    ss = time_prefill_steps(eng, n, warmup=1, repeats=reps)
    w = statistics.median(s.wall_s for s in ss)
    return {"prompt_tokens": n, "step_ms": w * 1e3,
            "forward_ms": statistics.median(s.forward_s for s in ss) * 1e3,
            "prefill_tok_per_s": n / w}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quant-max-tokens", type=int, default=None,
                    help="pin the quantized/dense crossover (default: measured at start-up, so it "
                         "moves with the machine's load; pin it to compare two builds)")
    ap.add_argument("--amx-max-tokens", type=int, default=None,
                    help="pin the AMX/oneDNN crossover (default: measured)")
    a = ap.parse_args()
    from sloserve.model import crossover
    if a.quant_max_tokens is not None:
        crossover.quant_crossover = lambda model, **k: a.quant_max_tokens
    if a.amx_max_tokens is not None:
        crossover.amx_crossover = lambda model: a.amx_max_tokens
    eng = LLMEngine(EngineConfig(model=a.model, load_format=a.load_format, dtype=a.dtype,
                                 # a decode batch's prompts prefill in one step: budget 16 x 128
                                 max_num_batched_tokens=2048, num_kv_blocks=1024))
    res = {"model": eng.model_name, "weights": eng.core.weights_line, "dtype": eng.dtype_choice.dtype, "torch_threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(),
           "decode": [decode_rate(eng, b, 128, a.steps) for b in (1, 16)],
           "prefill": prefill_time(eng, 512, 3)}
    for d in res["decode"]:
        print(f"decode batch {d['batch']:>2} (context {d['context_len']}): {d['decode_tok_per_s']:7.1f} tok/s, "
              f"step {d['step_ms']:.1f} ms, forward {d['forward_ms']:.1f} ms, prepare "
              f"{d['prepare_ms']:.2f} ms, sample {d['sample_ms']:.2f} ms, outside forward "
              f"{100 * d['outside_forward_share']:.1f} %")
    p = res["prefill"]
    print(f"prefill 512 tokens: {p['step_ms']:.1f} ms ({p['prefill_tok_per_s']:.0f} tok/s), "
          f"forward {p['forward_ms']:.1f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
