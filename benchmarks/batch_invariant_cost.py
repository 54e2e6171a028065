"""What ``--batch-invariant`` costs, in one process: two in-process engines on the same model
and dtype, one with the flag and one without, measured in alternation (so that a burst of load
on a shared machine hits both) on the compare table's three kinds of work:

* decode at batch 1 (the c=1 TPOT row): a pure decode step, context ~256;
* decode at batch 16 (the c=16 throughput row): a pure decode step of 16 sequences, ~300;
* prefill: one 256-token prompt in one step, and the time to the first token of one
  2048-token prompt through the default 512-token budget (4 chunks; the long stream of the
  interference row).

    .venv/bin/python benchmarks/batch_invariant_cost.py [--dtype auto] [--rounds 5]
        [--pin-crossovers 16,2048] [--clock cpu] [--out F]

Each figure is the median over the rounds (each round: a few steps of each kind, median
inside); the ratio column is with / without. Crossovers of the engine without the flag are
measured at its start, as a server's are (printed, since they move with the machine's load),
unless pinned (``--pin-crossovers``).

``--clock cpu`` (for a shared, busy host): the engines run on one torch thread and each step
is timed by the process's CPU time, which other jobs' time slices do not inflate (cache and
memory contention still do, on both sides alike); the default ``wall`` times steps as a user
sees them, on every thread.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams
from sloserve.tools.step_profile import start_decodes, synthetic_prompt

CLOCK = time.perf_counter


def timed_step(eng: LLMEngine) -> float:
    t0 = CLOCK()
    eng.step()
    return CLOCK() - t0


def decode_step_s(eng: LLMEngine, batch: int, context: int, steps: int) -> float:
    """Median of `steps` pure-decode steps of `batch` sequences from about `context` (the
    prompts prefilled in one step first, untimed)."""
    cfg = eng.scheduler.config
    budget, cfg.max_num_batched_tokens = cfg.max_num_batched_tokens, batch * context
    try:
        ids = start_decodes(eng, batch, context, steps + 3)
    finally:
        cfg.max_num_batched_tokens = budget
    timed_step(eng)  # warm-up
    out = [timed_step(eng) for _ in range(steps)]
    for rid in ids:
        eng.abort_request(rid)
    return statistics.median(out)


def prompt_ttft_s(eng: LLMEngine, n: int, seed: int) -> float:
    """Time from adding one fresh n-token prompt (nothing else running) to its first token:
    the steps until it is sampled, under the engine's own token budget."""
    rid = eng.add_request(synthetic_prompt(n, seed, eng.model_config.vocab_size),
                          SamplingParams(temperature=0.0, max_tokens=1))
    total = 0.0
    while eng.has_unfinished_requests():
        t0 = CLOCK()
        outs = eng.step()
        total += CLOCK() - t0
        if any(o.request_id == rid and o.new_token_ids for o in outs):
            break
    while eng.has_unfinished_requests():
        eng.step()
    return total


def one_round(eng: LLMEngine, r: int, steps: int) -> dict:
    med = statistics.median
    return {
        "decode_b1_ms": decode_step_s(eng, 1, 256, steps) * 1e3,
        "decode_b16_ms": decode_step_s(eng, 16, 300, steps) * 1e3,
        "prefill_256_ms": med(prompt_ttft_s(eng, 256, 7919 * r + i) for i in range(3)) * 1e3,
        "ttft_2048_ms": prompt_ttft_s(eng, 2048, 1000 + r) * 1e3,
    }


def main() -> None:
    global CLOCK
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pin-crossovers", default=None, metavar="QUANT,AMX",
                    help="the engine without the flag uses these crossovers instead of racing "
                         "the kernels at start-up (e.g. 16,2048, this host's usual outcome: the "
                         "race moves with the load)")
    a = ap.parse_args()
    if a.pin_crossovers:
        from sloserve.model import crossover
        quant, amx = (int(v) for v in a.pin_crossovers.split(","))
        crossover.quant_crossover = lambda model: quant
        crossover.amx_crossover = lambda model: amx
    if a.clock == "cpu":
        torch.set_num_threads(1)
        CLOCK = time.process_time
    # no prefix caching: every round's prompts are fresh work, as the compare bench's are
    engines = {name: LLMEngine(EngineConfig(dtype=a.dtype, batch_invariant=inv,
                                            enable_prefix_caching=False))
               for name, inv in (("default", False), ("batch_invariant", True))}
    pol = engines["default"].runner.model.policy
    print(f"default crossovers: quant_max_tokens={pol.quant_max_tokens} "
          f"amx_max_tokens={pol.amx_max_tokens}; dtype {engines['default'].dtype}; clock "
          f"{a.clock}, {torch.get_num_threads()} threads")
    rows: dict[str, list[dict]] = {n: [] for n in engines}
    for r in range(a.rounds):
        for name, eng in (engines.items() if r % 2 == 0 else reversed(engines.items())):
            rows[name].append(one_round(eng, r, a.steps))
        print(f"round {r}: " + "; ".join(
            f"{n} " + ", ".join(f"{k} {v:.1f}" for k, v in rows[n][-1].items()) for n in rows),
            flush=True)
    summary = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in rows.items()}
    print(f"{'metric':16} {'default':>10} {'--batch-invariant':>18} {'ratio':>7}")
    for k in summary["default"]:
        d, b = summary["default"][k], summary["batch_invariant"][k]
        print(f"{k:16} {d:10.1f} {b:18.1f} {b / d:7.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dtype": a.dtype, "clock": a.clock,
                       "crossovers": [pol.quant_max_tokens, pol.amx_max_tokens],
                       "rounds": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
