"""``sloserve sim``: simulate a benchmark run on the engine's own scheduler with a cost model;
prints the same summary and writes the same JSON as ``sloserve bench`` (so ``sloserve compare``
can diff a simulated and a measured run).

This module only parses the flags (once, ``allow_abbrev=False``) and refuses combinations that
would be ignored; ``setup`` builds the simulation, ``modes`` runs and reports it, ``presets``
holds the lecture presets, ``capacity`` the KV-capacity arithmetic.
"""
from __future__ import annotations

import argparse
import math
import sys

from sloserve.argtypes import parse_given, pos_float, pos_int
from sloserve.bench.metric_args import add_metric_args
from sloserve.bench.workload_args import add_workload_args
from sloserve.config import ROOFLINE_DTYPES, EngineConfig, add_scheduler_args
from sloserve.sim.presets import PRESET_REFUSES, PRESETS
from sloserve.slo import add_goodput_arg


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sloserve sim", description=__doc__, allow_abbrev=False)
    e = p.add_argument_group("simulated engine (the `sloserve serve` flags and defaults)")
    add_scheduler_args(e)
    e.add_argument("--kv-cache-memory", type=pos_float, default=EngineConfig.kv_cache_memory,
                   help="GiB of KV cache per instance when --num-kv-blocks is not given: blocks "
                        "of --roofline-model's KV in --dtype, else of the embedded SmolLM2 in "
                        "bf16 (2,912 blocks of 16 at 1 GiB); lecture-70b: 90 %% of 8 x 80 GiB "
                        "minus the weights")
    e.add_argument("--num-replicas", type=pos_int, default=1)
    e.add_argument("--router", default="least-outstanding",
                   choices=["round-robin", "least-outstanding", "prefix-affinity"])
    s = p.add_argument_group("speculative decoding (modelled: stand-in drafts accepted at a "
                             "given rate)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="the `sloserve serve` flag (vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'): the "
                        "engine's own drafter rules (k per batch size, the acceptance floor) "
                        "propose k drafts for every decoding request; any method, the model "
                        "methods' drafting passes not priced")
    s.add_argument("--spec-acceptance-rate", type=float, default=None, metavar="A",
                   help="with --speculative-config: the chance that a draft token is accepted "
                        "given that the drafts before it in the step were (0 to 1; the seeded "
                        "RNG of --seed). A step of k drafts then gives a request on average "
                        "1 + A + ... + A^k tokens (A = 0.88 and k = 4: 3.93, the mean acceptance "
                        "length measured on `copy`, benchmarks/README.md)")
    d = p.add_argument_group("prefill/decode disaggregation (both counts > 0 turn it on)")
    d.add_argument("--num-prefill-instances", type=pos_int, default=None)
    d.add_argument("--num-decode-instances", type=pos_int, default=None)
    d.add_argument("--kv-transfer-link", default="nic-200g",
                   help="nic-100g / nic-200g / nic-400g, nvlink (the --hardware's own link), or "
                        "a rate such as 0.4gbit: each instance's NIC, one direction, shared by "
                        "the transfers on it")
    d.add_argument("--kv-transfer-mode", choices=["eager", "layerwise"], default="layerwise")
    d.add_argument("--kv-transfer-latency-ms", type=float, default=0.0)
    d.add_argument("--kv-transfer-model", default=None,
                   help="model whose KV size crosses the link (a `sloserve roofline` preset, "
                        "config.json or GGUF; default: --roofline-model, else SmolLM2-135M)")
    k = p.add_argument_group("capacity search")
    k.add_argument("--find-capacity", action="store_true",
                   help="bisect the highest --request-rate whose P99 TTFT / P99 TPOT meet the "
                        "--slo-p99-* limits (the workload is regenerated at each rate)")
    k.add_argument("--slo-p99-ttft-ms", type=pos_float, default=None)
    k.add_argument("--slo-p99-tpot-ms", type=pos_float, default=None)
    k.add_argument("--slo-attainment", type=pos_float, default=None, metavar="FRAC",
                   help="instead of P99 limits: the fraction of requests that must meet every "
                        "--goodput limit (DistServe's goodput, e.g. 0.9)")
    k.add_argument("--capacity-range", default="0.1,100", metavar="LO,HI", help="req/s")
    w = p.add_argument_group("sweep and presets")
    w.add_argument("--request-rates", type=_rates, default=None, metavar="R1,R2,...",
                   help="simulate each rate: the `bench sweep` table, sweep.json and the Pareto "
                        "plot under --result-dir")
    w.add_argument("--result-dir", default="sim-sweep")
    w.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="lecture: the seed lab (8B-class on an H100: decode 22 ms per step, "
                        "prefill 35,000 tok/s; mixed, Poisson 6 req/s); lecture-70b: the same "
                        "workload on Llama-3-70B, 8 x H100 (roofline model). Both compare naive "
                        "and chunked (budget 512); workload, arrival and engine flags still "
                        "apply, flags that would change the comparison are refused")
    c = p.add_argument_group("cost model (one of)")
    c.add_argument("--profile", default=None,
                   help="a `sloserve profile` file: the linear model fitted to the real engine")
    c.add_argument("--decode-step-ms", type=pos_float, default=None,
                   help="overlap model: memory-bound decode step time (ms)")
    c.add_argument("--prefill-tokens-per-s", type=pos_float, default=None,
                   help="overlap model: prefill throughput (tokens/s)")
    c.add_argument("--step-overhead-ms", type=float, default=0.0)
    c.add_argument("--request-in-ms", type=float, default=None,
                   help="the server's path from a send to the engine's queue (default: the "
                        "--profile's measured value, else 0)")
    c.add_argument("--token-out-ms", type=float, default=None,
                   help="from a step's end to the client holding the token (default: the "
                        "--profile's measured value, else 0)")
    c.add_argument("--roofline-model", default=None,
                   help="roofline model: a `sloserve roofline` model preset, config.json or GGUF")
    c.add_argument("--hardware", default="H100-SXM", help="roofline model: hardware preset")
    c.add_argument("--tp", type=pos_int, default=1, help="roofline model: tensor parallel GPUs")
    c.add_argument("--dtype", default="bf16", metavar="{" + ",".join(ROOFLINE_DTYPES) + "}",
                   help="roofline model: weight/activation/KV dtype (the roofline's names)")
    c.add_argument("--compute-efficiency", type=pos_float, default=0.6)
    c.add_argument("--memory-efficiency", type=pos_float, default=0.8)
    o = p.add_argument_group("output")
    add_goodput_arg(o, "; goodput = simulated requests/s that meet it")
    o.add_argument("--report", default=None, metavar="FILE.html",
                   help="one self-contained HTML page of the run (or of a --request-rates "
                        "sweep: its points and Pareto plot), as sloserve bench --report writes")
    o.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write the result in `sloserve bench --save-detailed`'s format")
    o.add_argument("--label", default="sim")
    add_metric_args(o)
    o.add_argument("--ignore-eos", action="store_true",
                   help="accepted for `sloserve bench` compatibility: simulated outputs always "
                        "run to their length")
    add_workload_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sloserve sim``; 2 for bad settings (one line)."""
    from sloserve.sim.modes import run
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    try:  # one parse: the flags given, then the preset's settings, then the defaults
        a, given = parse_given(p, argv)
        if a.preset:
            a, given = parse_given(p, argv, PRESETS[a.preset])
        _check_combinations(a, given)
        a.command = ["sloserve", "sim", *argv]  # (for --report)
        return run(a)
    except KeyError as e:  # unknown model, hardware or dtype: the message is the argument
        print(f"sloserve sim: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"sloserve sim: error: {e}", file=sys.stderr)
        return 2


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_combinations(a: argparse.Namespace, given: set[str]) -> None:
    """Flags that would be silently ignored together are refused (ValueError); ``given`` are
    the dests of the flags on the command line."""
    modes = [_flag(d) for d in ("preset", "find_capacity", "request_rates") if d in given]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are different runs: give one")
    if "save_result" in given and (a.preset or a.find_capacity or a.request_rates):
        raise ValueError("--save-result is for a single run (a sweep writes under --result-dir)")
    if "report" in given and (a.preset or a.find_capacity):
        raise ValueError("--report is for a single run or a --request-rates sweep")
    if a.preset:
        clash = sorted(_flag(d) for d in given & set(PRESET_REFUSES))
        if clash:
            raise ValueError(f"--preset {a.preset} compares naive and chunked on its own cost "
                             f"model; {', '.join(clash)} would change what it shows "
                             f"(run without --preset to set them)")
    slo = given & {"slo_p99_ttft_ms", "slo_p99_tpot_ms", "slo_attainment"}
    if slo and not a.find_capacity:
        raise ValueError(f"{', '.join(sorted(map(_flag, slo)))} only apply with --find-capacity")
    if "slo_attainment" in given and slo - {"slo_attainment"}:
        raise ValueError("--slo-attainment (with --goodput limits) and --slo-p99-* are two "
                         "kinds of target: give one")
    if a.spec_acceptance_rate is not None and not a.speculative_config:
        raise ValueError("--spec-acceptance-rate only applies with --speculative-config")
    if a.speculative_config:
        if a.spec_acceptance_rate is None:
            raise ValueError("--speculative-config needs --spec-acceptance-rate A (the chance "
                             "that a draft token is accepted, given the ones before it were)")
        if not (math.isfinite(a.spec_acceptance_rate) and 0 <= a.spec_acceptance_rate <= 1):
            raise ValueError(f"--spec-acceptance-rate must be in [0, 1], got "
                             f"{a.spec_acceptance_rate:g}")
