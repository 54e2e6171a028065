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
import time

import torch

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams


def decode_rate(eng: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict:
    """Run `batch` requests to steady decode, then time `steps` decode-only steps."""
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request([(7 * i + j) % 1000 + 10 for j in range(prompt_len)], sp)
    while any(r.is_prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    walls, fwds, prep, samp = [], [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
        tm = eng.runner.last_timings
        fwds.append(tm.forward_s)
        prep.append(tm.prepare_s)
        samp.append(tm.sample_s)
    while eng.has_unfinished_requests():
        eng.step()
    w = statistics.median(walls)
    f = statistics.median(fwds)
    return {"batch": batch, "context_len": prompt_len, "step_ms": w * 1e3, "forward_ms": f * 1e3,
            "prepare_ms": statistics.median(prep) * 1e3, "sample_ms": statistics.median(samp) * 1e3,
            "decode_tok_per_s": batch / w, "outside_forward_share": 1 - f / w}


def prefill_time(eng: LLMEngine, n: int, reps: int) -> dict:
    times, fwd = [], []
    for r in range(reps + 1):
        eng.add_request([(11 * j + r) % 1000 + 10 for j in range(n)],
                        SamplingParams(temperature=0.0, max_tokens=1))
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        if r:  # first one warms up
            times.append(dt)
            fwd.append(eng.runner.last_timings.forward_s)
        while eng.has_unfinished_requests():
            eng.step()
    return {"prompt_tokens": n, "step_ms": statistics.median(times) * 1e3,
            "forward_ms": statistics.median(fwd) * 1e3,
            "prefill_tok_per_s": n / statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    eng = LLMEngine(EngineConfig(model=a.model, load_format=a.load_format, dtype=a.dtype,
                                 max_num_batched_tokens=512, num_kv_blocks=1024))
    res = {"model": eng.model_name, "dtype": a.dtype, "torch_threads": torch.get_num_threads(),
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
