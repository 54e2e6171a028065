"""``sloserve sim``: simulate a benchmark run on the engine's own scheduler with a cost model;
prints the same summary and writes the same JSON as ``sloserve bench`` (so ``sloserve compare``
can diff a simulated and a measured run)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from sloserve.argtypes import pos_float, pos_int
from sloserve.bench.metrics import calculate_metrics, parse_goodput
from sloserve.bench.workload_args import (add_workload_args, arrival_process, build_workload,
                                          check_workload_flags)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sloserve sim", description=__doc__)
    e = p.add_argument_group("simulated engine (as the `sloserve serve` flags)")
    e.add_argument("--max-num-batched-tokens", type=pos_int, default=512)
    e.add_argument("--max-num-seqs", type=pos_int, default=64)
    e.add_argument("--max-model-len", type=pos_int, default=8192)
    e.add_argument("--scheduling-policy", choices=["chunked", "naive", "static"], default="chunked")
    e.add_argument("--num-kv-blocks", type=pos_int, default=2848,
                   help="KV blocks (default: what 1 GiB holds for the embedded SmolLM2 in bf16)")
    e.add_argument("--block-size", type=pos_int, default=16)
    e.add_argument("--num-replicas", type=pos_int, default=1)
    e.add_argument("--router", default="least-outstanding",
                   choices=["round-robin", "least-outstanding", "prefix-affinity"])
    k = p.add_argument_group("capacity search")
    k.add_argument("--find-capacity", action="store_true",
                   help="bisect the highest --request-rate whose P99 TTFT / P99 TPOT meet the "
                        "--slo-p99-* limits (the workload is regenerated at each rate)")
    k.add_argument("--slo-p99-ttft-ms", type=pos_float, default=None)
    k.add_argument("--slo-p99-tpot-ms", type=pos_float, default=None)
    k.add_argument("--capacity-range", default="0.1,100", metavar="LO,HI", help="req/s")
    c = p.add_argument_group("cost model (one of)")
    c.add_argument("--profile", default=None,
                   help="a `sloserve profile` file: the linear model fitted to the real engine")
    c.add_argument("--decode-step-ms", type=pos_float, default=None,
                   help="overlap model: memory-bound decode step time (ms)")
    c.add_argument("--prefill-tokens-per-s", type=pos_float, default=None,
                   help="overlap model: prefill throughput (tokens/s)")
    c.add_argument("--step-overhead-ms", type=float, default=0.0)
    c.add_argument("--roofline-model", default=None,
                   help="roofline model: a `sloserve roofline` model preset, config.json or GGUF")
    c.add_argument("--hardware", default="H100-SXM", help="roofline model: hardware preset")
    c.add_argument("--tp", type=pos_int, default=1, help="roofline model: tensor parallel GPUs")
    c.add_argument("--dtype", default="bf16", help="roofline model: weight/activation/KV dtype")
    c.add_argument("--compute-efficiency", type=pos_float, default=0.6)
    c.add_argument("--memory-efficiency", type=pos_float, default=0.8)
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS")
    o.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write the result in `sloserve bench --save-detailed`'s format")
    o.add_argument("--label", default="sim")
    o.add_argument("--ignore-eos", action="store_true",
                   help="accepted for `sloserve bench` compatibility: simulated outputs always "
                        "run to their length")
    add_workload_args(p)
    return p


def _cost_model(a: argparse.Namespace):
    from sloserve.sim.cost_model import OverlapCostModel
    from sloserve.sim.profile import load_profile
    overlap = a.decode_step_ms is not None or a.prefill_tokens_per_s is not None
    if sum((bool(a.profile), overlap, bool(a.roofline_model))) != 1:
        raise ValueError("give either --profile FILE, or both --decode-step-ms and "
                         "--prefill-tokens-per-s, or --roofline-model MODEL")
    if a.roofline_model:
        from sloserve.roofline.hardware import get_hardware
        from sloserve.roofline.models import get_model
        from sloserve.sim.cost_model import RooflineCostModel
        m = RooflineCostModel(get_model(a.roofline_model), get_hardware(a.hardware), a.dtype, a.tp,
                              a.compute_efficiency, a.memory_efficiency, a.step_overhead_ms / 1e3)
        return m, (f"roofline ({a.roofline_model} on {a.tp} x {a.hardware}, {a.dtype}, efficiency "
                   f"compute {a.compute_efficiency:g} / memory {a.memory_efficiency:g})")
    if a.profile:
        return load_profile(a.profile), f"profiled ({a.profile})"
    if a.decode_step_ms is None or a.prefill_tokens_per_s is None:
        raise ValueError("the overlap model needs both --decode-step-ms and --prefill-tokens-per-s")
    return (OverlapCostModel(a.decode_step_ms / 1e3, a.prefill_tokens_per_s, a.step_overhead_ms / 1e3),
            f"overlap (decode {a.decode_step_ms:g} ms, prefill {a.prefill_tokens_per_s:g} tok/s)")


def run(a: argparse.Namespace) -> int:
    """Simulate, print the summary, save the JSON. Returns the exit code."""
    from sloserve.bench.arrivals import arrival_times
    from sloserve.bench.results import format_summary, result_json, save_json
    from sloserve.bench.runner import BenchConfig, BenchmarkRun
    from sloserve.sim.simulator import SimConfig, simulate_cluster
    from sloserve.sim.workload import LengthOnlyFactory
    slos = parse_goodput(a.goodput)
    check_workload_flags(a)
    if a.max_concurrency is not None:
        raise ValueError("--max-concurrency (a closed loop) is not simulated yet; use a request rate")
    cost, cost_name = _cost_model(a)
    if a.dataset_name == "sharegpt":
        from sloserve.bench.datasets import PromptFactory
        from sloserve.bench.tokenizer import load_tokenizer
        from sloserve.model.loader import default_model_path
        factory = PromptFactory(load_tokenizer(default_model_path()), seed=a.seed)
    else:
        factory = LengthOnlyFactory()
    reqs = build_workload(a, factory)
    if any(r.arrival_time is not None for r in reqs):
        arr = [r.arrival_time or 0.0 for r in reqs]
    else:
        arr = list(arrival_times(len(reqs), a.request_rate, process=arrival_process(a),
                                 burstiness=a.burstiness, seed=a.seed))
    cfg = SimConfig(a.max_num_batched_tokens, a.max_num_seqs, a.max_model_len, a.scheduling_policy,
                    a.num_kv_blocks, a.block_size)
    if a.find_capacity:
        return _capacity(a, reqs, cfg, cost, cost_name)
    t0 = time.perf_counter()
    res = simulate_cluster(reqs, arr, cfg, cost, a.num_replicas, a.router)
    wall = time.perf_counter() - t0
    metrics = calculate_metrics(res.records, res.duration, goodput_slos=slos, start_time=0.0)
    bc = BenchConfig(base_url="sim://", model=a.label, request_rate=a.request_rate,
                     burstiness=a.burstiness, seed=a.seed, goodput=slos)
    run_ = BenchmarkRun(bc, reqs, res.records, 0.0, res.duration, metrics)
    print(f"sim: {len(reqs)} {a.dataset_name} requests, {a.num_replicas} replica(s) "
          f"({a.router}), policy {cfg.policy}, budget "
          f"{cfg.max_num_batched_tokens}, cost model {cost_name}; {res.num_preemptions} "
          f"preemptions; {len(reqs) / wall:.0f} requests simulated per s of wall time",
          file=sys.stderr)
    print(format_summary(metrics, title="Simulated Serving Benchmark Result"))
    if a.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(a.save_result)), exist_ok=True)
        save_json(result_json(run_, label=a.label, detailed=True,
                              metadata={"simulated": True, "scheduling_policy": cfg.policy,
                                        "max_num_batched_tokens": cfg.max_num_batched_tokens,
                                        "cost_model": cost_name}), a.save_result)
        print(f"result: {a.save_result}")
    return 0


def _capacity(a, reqs, cfg, cost, cost_name) -> int:
    """--find-capacity: bisect the rate; print it and the run at it."""
    from sloserve.bench.arrivals import arrival_times
    from sloserve.sim.simulator import find_capacity, simulate_cluster
    slos = {"ttft": a.slo_p99_ttft_ms, "tpot": a.slo_p99_tpot_ms}
    slos = {k: v for k, v in slos.items() if v is not None}
    if not slos:
        raise ValueError("--find-capacity needs --slo-p99-ttft-ms and/or --slo-p99-tpot-ms")
    try:
        lo, hi = (float(x) for x in a.capacity_range.split(","))
    except ValueError:
        raise ValueError(f"--capacity-range takes LO,HI, got {a.capacity_range!r}") from None

    def run(rate):
        arr = arrival_times(len(reqs), rate, process=arrival_process(a),
                            burstiness=a.burstiness, seed=a.seed)
        res = simulate_cluster(reqs, arr, cfg, cost, a.num_replicas, a.router)
        return calculate_metrics(res.records, res.duration)

    def meets(m):
        return m.failed == 0 and all(m.stats[k].p(99) <= v for k, v in slos.items())
    cap = find_capacity(run, meets, lo, hi)
    limits = ", ".join(f"P99 {k.upper()} <= {v:g} ms" for k, v in slos.items())
    if cap is None:
        print(f"capacity: no rate in [{lo:g}, {hi:g}] req/s meets {limits} ({cost_name})")
        return 1
    m = run(cap)
    print(f"capacity: {cap:.3f} req/s meets {limits} on {a.num_replicas} replica(s), policy "
          f"{cfg.policy}, budget {cfg.max_num_batched_tokens} ({cost_name}); there: P99 TTFT "
          f"{m.stats['ttft'].p(99):.1f} ms, P99 TPOT {m.stats['tpot'].p(99):.1f} ms, output "
          f"{m.output_throughput:.1f} tok/s" + (" (the top of the range)" if cap == hi else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sloserve sim``; 2 for bad settings (one line)."""
    a = _parser().parse_args(argv)
    try:
        return run(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"sloserve sim: error: {e}", file=sys.stderr)
        return 2
