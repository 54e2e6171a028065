"""What ``--batch-invariant`` costs, in one process: two in-process engines on the same model
and dtype, one with the flag and one without, measured in alternation (so that a burst of load
on a shared machine hits both) on the compare table's three kinds of work:

* decode at batch 1 (the c=1 TPOT row): a pure decode step, context ~256;
* decode at batch 16 (the c=16 throughput row): a pure decode step of 16 sequences, ~300;
* prefill: one 256-token prompt in one step, and the time to the first token of one
  2048-token prompt through the default 512-token budget (4 chunks; the long stream of the
  interference row).

    .venv/bin/python benchmarks/batch_invariant_cost.py [--dtype auto] [--rounds 5] [--out F]

Each figure is the median over the rounds (each round: a few steps of each kind, median
inside); the ratio column is with / without. Crossovers of the engine without the flag are
measured at its start, as a server's are (printed, since they move with the machine's load).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams
from sloserve.tools.step_profile import synthetic_prompt, time_decode_steps, time_prefill_steps


def long_prompt_ttft(eng: LLMEngine, n: int, seed: int) -> float:
    """Seconds from adding one fresh n-token prompt (nothing else running) to its first token."""
    rid = eng.add_request(synthetic_prompt(n, seed, eng.model_config.vocab_size),
                          SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.new_token_ids:
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def wait_quiet(max_wait_s: float) -> float:
    """Wait until this machine's run queue holds nothing but us (``/proc/loadavg``'s running
    count <= 1, three polls in a row), at most max_wait_s; returns the seconds waited. On a
    shared host another job's burst otherwise lands inside one side's round."""
    t0 = time.monotonic()
    calm = 0
    while calm < 3 and time.monotonic() - t0 < max_wait_s:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        calm = calm + 1 if running <= 1 else 0
        time.sleep(0.2)
    return time.monotonic() - t0


def one_round(eng: LLMEngine, r: int, steps: int) -> dict:
    med = statistics.median
    out = {}
    out["decode_b1_ms"] = med(s.wall_s for s in time_decode_steps(eng, 1, 256, 1, steps)) * 1e3
    cfg = eng.scheduler.config  # the 16 prompts prefilled in one step, so that they decode together
    budget, cfg.max_num_batched_tokens = cfg.max_num_batched_tokens, 16 * 300
    try:
        out["decode_b16_ms"] = med(s.wall_s for s in time_decode_steps(eng, 16, 300, 1, steps)) * 1e3
    finally:
        cfg.max_num_batched_tokens = budget
    out["prefill_256_ms"] = med(s.wall_s for s in time_prefill_steps(eng, 256, 1, 3)) * 1e3
    out["ttft_2048_ms"] = long_prompt_ttft(eng, 2048, 1000 + r) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each side's round wait up to S seconds for an idle run queue "
                         "(a shared machine; 0: no wait)")
    a = ap.parse_args()
    # no prefix caching: every round's prompts are fresh work, as the compare bench's are
    engines = {name: LLMEngine(EngineConfig(dtype=a.dtype, batch_invariant=inv,
                                            enable_prefix_caching=False))
               for name, inv in (("default", False), ("batch_invariant", True))}
    pol = engines["default"].runner.model.policy
    print(f"default crossovers: quant_max_tokens={pol.quant_max_tokens} "
          f"amx_max_tokens={pol.amx_max_tokens}; dtype {engines['default'].dtype}")
    rows: dict[str, list[dict]] = {n: [] for n in engines}
    for r in range(a.rounds):
        for name, eng in (engines.items() if r % 2 == 0 else reversed(engines.items())):
            if a.quiet_wait:
                wait_quiet(a.quiet_wait)
            rows[name].append(one_round(eng, r, a.steps))
        print(f"round {r}: " + "; ".join(
            f"{n} " + ", ".join(f"{k} {v:.1f}" for k, v in rows[n][-1].items()) for n in rows))
    summary = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in rows.items()}
    print(f"{'metric':16} {'default':>10} {'--batch-invariant':>18} {'ratio':>7}")
    for k in summary["default"]:
        d, b = summary["default"][k], summary["batch_invariant"][k]
        print(f"{k:16} {d:10.1f} {b:18.1f} {b / d:7.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"dtype": a.dtype, "crossovers": [pol.quant_max_tokens, pol.amx_max_tokens],
                       "rounds": rows, "median": summary}, f, indent=1)


if __name__ == "__main__":
    main()
