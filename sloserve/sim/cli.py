"""``sloserve sim``: simulate a benchmark run on the engine's own scheduler with a cost model;
prints the same summary and writes the same JSON as ``sloserve bench`` (so ``sloserve compare``
can diff a simulated and a measured run)."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from sloserve.argtypes import pos_float, pos_int
from sloserve.bench.metrics import calculate_metrics, parse_goodput
from sloserve.bench.workload_args import (add_workload_args, arrival_process, build_workload,
                                          check_workload_flags)


PRESETS: dict[str, dict] = {
    "lecture": {"dataset_name": "mixed", "request_rate": 6.0, "num_prompts": 2000,
                "decode_step_ms": 22.0, "prefill_tokens_per_s": 35000.0,
                "max_num_batched_tokens": 512, "num_kv_blocks": 100_000},
    "lecture-70b": {"dataset_name": "mixed", "request_rate": 6.0, "num_prompts": 2000,
                    "roofline_model": "Llama-3-70B", "hardware": "H100-SXM", "tp": 8,
                    "max_num_batched_tokens": 512, "num_kv_blocks": None},
}


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return rates


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sloserve sim", description=__doc__)
    e = p.add_argument_group("simulated engine (as the `sloserve serve` flags)")
    e.add_argument("--max-num-batched-tokens", type=pos_int, default=512)
    e.add_argument("--max-num-seqs", type=pos_int, default=64)
    e.add_argument("--max-model-len", type=pos_int, default=8192)
    e.add_argument("--scheduling-policy", choices=["chunked", "naive", "static"], default="chunked")
    e.add_argument("--num-kv-blocks", type=pos_int, default=2848,
                   help="KV blocks per instance (default: what 1 GiB holds for the embedded "
                        "SmolLM2 in bf16; lecture-70b: 90 %% of 8 x 80 GiB minus the weights)")
    e.add_argument("--block-size", type=pos_int, default=16)
    e.add_argument("--num-replicas", type=pos_int, default=1)
    e.add_argument("--router", default="least-outstanding",
                   choices=["round-robin", "least-outstanding", "prefix-affinity"])
    d = p.add_argument_group("prefill/decode disaggregation (both counts > 0 turn it on)")
    d.add_argument("--num-prefill-instances", type=pos_int, default=None)
    d.add_argument("--num-decode-instances", type=pos_int, default=None)
    d.add_argument("--kv-transfer-link", default="nic-200g",
                   help="nic-100g / nic-200g / nic-400g, or nvlink (the --hardware's own link)")
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


def _disaggregation(a: argparse.Namespace):
    """The P/D setup of the flags, or None. KV size and layers from --kv-transfer-model, else
    --roofline-model, else SmolLM2-135M (the embedded model); KV per token split over --tp GPUs,
    each sending its share over its own link."""
    p, d = a.num_prefill_instances, a.num_decode_instances
    if p is None and d is None:
        return None
    if p is None or d is None:
        raise ValueError("disaggregation needs both --num-prefill-instances and "
                         "--num-decode-instances")
    if a.num_replicas != 1:
        raise ValueError("--num-replicas is for colocated replicas; with disaggregation give "
                         "--num-prefill-instances and --num-decode-instances")
    from sloserve.roofline.hardware import get_hardware, get_link
    from sloserve.roofline.kv import kv_bytes_per_token
    from sloserve.roofline.models import get_model
    from sloserve.sim.kv_transfer import Disaggregation, KVTransferModel
    spec = get_model(a.kv_transfer_model or a.roofline_model or "SmolLM2-135M")
    hw = get_hardware(a.hardware)
    if a.kv_transfer_link in ("nvlink", "scale-up") and hw.link is None:
        raise ValueError(f"--hardware {a.hardware} has no scale-up link for --kv-transfer-link "
                         f"{a.kv_transfer_link}; use a NIC (nic-100g, nic-200g, nic-400g)")
    try:
        link = get_link(a.kv_transfer_link, hw)
    except KeyError as e:
        raise ValueError(str(e.args[0])) from None
    kv = kv_bytes_per_token(spec, a.dtype)
    return Disaggregation(p, d, KVTransferModel(kv / a.tp, link.bandwidth, spec.num_layers,
                                                a.kv_transfer_mode, a.kv_transfer_latency_ms / 1e3))


def _lecture_70b_blocks(a: argparse.Namespace) -> int:
    """KV blocks that 90 % of tp x the GPU's memory hold after the weights (roofline specs)."""
    from sloserve.roofline.hardware import get_hardware
    from sloserve.roofline.kv import kv_bytes_per_token
    from sloserve.roofline.models import get_model
    from sloserve.roofline.kv import dtype_bytes
    spec, hw = get_model(a.roofline_model), get_hardware(a.hardware)
    free = 0.9 * a.tp * hw.mem_bytes - spec.num_params() * dtype_bytes(a.dtype)
    return max(1, int(free // (kv_bytes_per_token(spec, a.dtype) * a.block_size)))


class _Sim:
    """A configured simulation: the workload, the engine settings, the cost model."""

    def __init__(self, a: argparse.Namespace):
        from sloserve.sim.simulator import SimConfig
        from sloserve.sim.workload import LengthOnlyFactory
        self.a = a
        self.slos = parse_goodput(a.goodput)
        check_workload_flags(a)
        self.cost, self.cost_name = _cost_model(a)
        self.dis = _disaggregation(a)
        if a.dataset_name == "sharegpt":
            from sloserve.bench.datasets import PromptFactory
            from sloserve.bench.tokenizer import load_tokenizer
            from sloserve.embedded import default_model_path
            factory = PromptFactory(load_tokenizer(default_model_path()), seed=a.seed)
        else:
            factory = LengthOnlyFactory()
        self.reqs = build_workload(a, factory)
        if not self.reqs:
            raise ValueError("the workload has no requests")
        self.trace_arrivals = any(r.arrival_time is not None for r in self.reqs)
        if self.trace_arrivals and (a.find_capacity or a.request_rates):
            raise ValueError("a trace replays its own arrival times: --find-capacity and "
                             "--request-rates need generated arrivals (--request-rate)")
        into, out = (0.0, 0.0)
        if a.profile:
            from sloserve.sim.profile import load_frontend
            into, out = load_frontend(a.profile)
        into = into if a.request_in_ms is None else a.request_in_ms / 1e3
        out = out if a.token_out_ms is None else a.token_out_ms / 1e3
        if not (0 <= into < math.inf and 0 <= out < math.inf):
            raise ValueError(f"the server path (--request-in-ms, --token-out-ms, or the "
                             f"profile's) must be finite and >= 0, got {1e3 * into} ms in and "
                             f"{1e3 * out} ms out")
        self.cfg = SimConfig(a.max_num_batched_tokens, a.max_num_seqs, a.max_model_len,
                             a.scheduling_policy, a.num_kv_blocks, a.block_size, into, out)
        if into or out:
            self.cost_name += (f", server path {1e3 * into:.1f} ms in / {1e3 * out:.1f} ms out")

    def arrivals(self, rate: float) -> list[float]:
        from sloserve.bench.arrivals import arrival_times
        if self.trace_arrivals:
            return [r.arrival_time or 0.0 for r in self.reqs]
        a = self.a
        return list(arrival_times(len(self.reqs), rate, process=arrival_process(a),
                                  burstiness=a.burstiness, seed=a.seed))

    def run(self, rate: float, cfg=None):
        """(SimResult, BenchmarkMetrics) at ``rate`` req/s."""
        from sloserve.sim.simulator import simulate_cluster
        a = self.a
        res = simulate_cluster(self.reqs, self.arrivals(rate), cfg or self.cfg, self.cost,
                               a.num_replicas, a.router, max_concurrency=a.max_concurrency,
                               disaggregation=self.dis)
        return res, calculate_metrics(res.records, res.duration, goodput_slos=self.slos,
                                      start_time=0.0)

    def describe(self, cfg=None) -> str:
        a, cfg = self.a, cfg or self.cfg
        where = (f"{self.dis.num_prefill} prefill + {self.dis.num_decode} decode instances "
                 f"(KV over {a.kv_transfer_link}, {a.kv_transfer_mode})" if self.dis else
                 f"{a.num_replicas} replica(s) ({a.router})")
        return (f"{len(self.reqs)} {a.dataset_name} requests, {where}, policy {cfg.policy}, "
                f"budget {cfg.max_num_batched_tokens}, cost model {self.cost_name}")


def run(a: argparse.Namespace) -> int:
    """Simulate, print the summary, save the JSON (or a sweep, a capacity search, a preset).
    Returns the exit code."""
    from sloserve.bench.results import format_summary, result_json, save_json
    from sloserve.bench.runner import BenchConfig, BenchmarkRun
    if a.save_result:  # fail before the run, not after it
        path = os.path.abspath(a.save_result)
        parent = os.path.dirname(path)
        if os.path.isdir(path) or (os.path.exists(parent) and not os.path.isdir(parent)):
            raise ValueError(f"--save-result {a.save_result}: not a writable file path")
    sim = _Sim(a)
    if a.preset:
        return _preset(sim)
    if a.find_capacity:
        return _capacity(sim)
    if a.request_rates:
        return _sweep(sim)
    t0 = time.perf_counter()
    res, metrics = sim.run(a.request_rate)
    wall = time.perf_counter() - t0
    bc = BenchConfig(base_url="sim://", model=a.label, request_rate=a.request_rate,
                     burstiness=a.burstiness, seed=a.seed, goodput=sim.slos,
                     max_concurrency=a.max_concurrency)
    run_ = BenchmarkRun(bc, sim.reqs, res.records, 0.0, res.duration, metrics)
    extra = ""
    if res.kv_transfer_s:
        extra = (f"; KV transfer exposed mean {1e3 * sum(res.kv_transfer_s) / len(res.kv_transfer_s):.2f}"
                 f" ms, max {1e3 * max(res.kv_transfer_s):.2f} ms")
    print(f"sim: {sim.describe()}; {res.num_preemptions} preemptions; mean requests in flight "
          f"{res.mean_in_flight:.2f}{extra}; {len(sim.reqs) / wall:.0f} requests simulated per s "
          f"of wall time", file=sys.stderr)
    print(format_summary(metrics, title="Simulated Serving Benchmark Result"))
    if a.save_result:
        os.makedirs(os.path.dirname(os.path.abspath(a.save_result)), exist_ok=True)
        save_json(result_json(run_, label=a.label, detailed=True,
                              metadata={"simulated": True, "scheduling_policy": sim.cfg.policy,
                                        "max_num_batched_tokens": sim.cfg.max_num_batched_tokens,
                                        "cost_model": sim.cost_name}), a.save_result)
        print(f"result: {a.save_result}")
    return 0


def _sweep(sim: _Sim) -> int:
    """--request-rates: one simulated run per rate; the bench sweep's table, JSON and plot."""
    from sloserve.bench.results import metrics_dict
    from sloserve.bench.sweep import write_sweep
    a = sim.a
    os.makedirs(a.result_dir, exist_ok=True)
    rows = []
    for rate in a.request_rates:
        _, m = sim.run(rate)
        rows.append({"point": rate, **metrics_dict(m)})
    print(f"sim sweep: {sim.describe()}", file=sys.stderr)
    write_sweep(rows, "request_rate", sim.slos, a.result_dir,
                f"simulated: {sim.cfg.policy}, budget {sim.cfg.max_num_batched_tokens}")
    return 0


def _capacity(sim: _Sim) -> int:
    """--find-capacity: bisect the rate; print it and the run at it."""
    from sloserve.sim.simulator import find_capacity
    a = sim.a
    if a.slo_attainment is not None:
        if not sim.slos:
            raise ValueError("--slo-attainment needs the per-request limits in --goodput "
                             "(e.g. --goodput ttft:2000 tpot:40)")
        if not 0 < a.slo_attainment <= 1:
            raise ValueError(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")
        limits = (f"{100 * a.slo_attainment:g} % of requests within "
                  + " and ".join(f"{k.upper()} {v:g} ms" for k, v in sim.slos.items()))

        def meets(m):
            return m.num_good >= a.slo_attainment * (m.completed + m.failed)
    else:
        slos = {"ttft": a.slo_p99_ttft_ms, "tpot": a.slo_p99_tpot_ms}
        slos = {k: v for k, v in slos.items() if v is not None}
        if not slos:
            raise ValueError("--find-capacity needs --slo-p99-ttft-ms and/or --slo-p99-tpot-ms, "
                             "or --slo-attainment with --goodput")
        limits = ", ".join(f"P99 {k.upper()} <= {v:g} ms" for k, v in slos.items())

        def meets(m):
            return m.failed == 0 and all(m.stats[k].p(99) <= v for k, v in slos.items())
    try:
        lo, hi = (float(x) for x in a.capacity_range.split(","))
    except ValueError:
        raise ValueError(f"--capacity-range takes LO,HI, got {a.capacity_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"--capacity-range must be finite, got {a.capacity_range!r}")
    cap = find_capacity(lambda r: sim.run(r)[1], meets, lo, hi)
    if cap is None:
        print(f"capacity: no rate in [{lo:g}, {hi:g}] req/s meets {limits} ({sim.describe()})")
        return 1
    m = sim.run(cap)[1]
    att = (f", attainment {100 * m.num_good / max(1, m.completed + m.failed):.1f} %"
           if sim.slos else "")
    print(f"capacity: {cap:.3f} req/s meets {limits} ({sim.describe()}); there: P99 TTFT "
          f"{m.stats['ttft'].p(99):.1f} ms, P99 TPOT {m.stats['tpot'].p(99):.1f} ms, output "
          f"{m.output_throughput:.1f} tok/s{att}" + (" (the top of the range)" if cap == hi else ""))
    return 0


def _preset(sim: _Sim) -> int:
    """--preset: naive against chunked (the --max-num-batched-tokens budget) on one workload."""
    from dataclasses import replace
    a = sim.a
    rows = []
    for policy in ("naive", "chunked"):
        cfg = replace(sim.cfg, policy=policy)
        res, m = sim.run(a.request_rate, cfg)
        t = m.stats["tpot"]
        rows.append((policy, t.p(50), t.p(90), t.p(99), m.stats["ttft"].mean,
                     m.stats["ttft"].p(99), m.output_throughput, res.num_preemptions, m.failed))
    print(f"preset {a.preset}: {sim.describe(cfg).replace('policy chunked', 'naive vs chunked')}"
          f", Poisson {a.request_rate:g} req/s, seed {a.seed}, {a.num_kv_blocks} KV blocks of "
          f"{a.block_size}")
    print("| policy | TPOT P50 ms | TPOT P90 ms | TPOT P99 ms | TTFT mean ms | TTFT P99 ms "
          "| output tok/s | preemptions | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} "
              f"| {r[6]:.1f} | {r[7]} | {r[8]} |")
    n, c = rows
    rel = lambda new, old: f"{100 * (new - old) / old:+.1f} %" if old else "n/a"  # noqa: E731
    print(f"chunked vs naive: P99 TPOT {rel(c[3], n[3])}, mean TTFT {rel(c[4], n[4])}")
    if n[8] or c[8]:
        print(f"{n[8]} (naive) and {c[8]} (chunked) of {len(sim.reqs)} requests failed (over "
              f"max_model_len or the KV cache): the figures cover the rest")
        return 1
    return 0


def _apply_preset(p: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make the preset's settings the defaults, so flags given on the command line still win."""
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--preset", choices=sorted(PRESETS), default=None)
    known, _ = probe.parse_known_args(argv)
    if known.preset:
        p.set_defaults(**PRESETS[known.preset])


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sloserve sim``; 2 for bad settings (one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    _apply_preset(p, argv)
    a = p.parse_args(argv)
    try:
        _check_combinations(a, argv)
        if a.preset == "lecture-70b" and a.num_kv_blocks is None:
            a.num_kv_blocks = _lecture_70b_blocks(a)
        return run(a)
    except KeyError as e:  # unknown model, hardware or dtype: the message is the argument
        print(f"sloserve sim: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"sloserve sim: error: {e}", file=sys.stderr)
        return 2


def _check_combinations(a: argparse.Namespace, argv: list[str]) -> None:
    """Flags that would be silently ignored together are refused (ValueError)."""
    given = {x.split("=")[0] for x in argv if x.startswith("--")}
    modes = [f for f in ("--preset", "--find-capacity", "--request-rates") if f in given]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are different runs: give one")
    if "--save-result" in given and (a.preset or a.find_capacity or a.request_rates):
        raise ValueError("--save-result is for a single run (a sweep writes under --result-dir)")
    if a.preset:
        clash = given & {"--scheduling-policy", "--profile", "--decode-step-ms",
                         "--prefill-tokens-per-s", "--roofline-model"}
        if clash:
            raise ValueError(f"--preset {a.preset} compares naive and chunked on its own cost "
                             f"model; {', '.join(sorted(clash))} would change what it shows "
                             f"(run without --preset to set them)")
    slo = given & {"--slo-p99-ttft-ms", "--slo-p99-tpot-ms", "--slo-attainment"}
    if slo and not a.find_capacity:
        raise ValueError(f"{', '.join(sorted(slo))} only apply with --find-capacity")
    if "--slo-attainment" in given and slo - {"--slo-attainment"}:
        raise ValueError("--slo-attainment (with --goodput limits) and --slo-p99-* are two "
                         "kinds of target: give one")
