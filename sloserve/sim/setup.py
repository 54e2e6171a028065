"""A configured simulation from ``sloserve sim``'s flags: the workload, the simulated engine, the
cost model and, with disaggregation, the KV link."""
from __future__ import annotations

import argparse
import math

from sloserve.bench.metric_args import check_metric_flags
from sloserve.config import QUEUE_POLICIES, batching_from_args
from sloserve.bench.metrics import calculate_metrics
from sloserve.slo import parse_goodput
from sloserve.bench.workload_args import arrival_process, build_workload, check_workload_flags

#: the context length of a simulated instance when --max-model-len is not given (tokens; the
#: embedded SmolLM2's), capped at what its KV cache holds, as the engine caps it
SIM_MODEL_LEN = 8192


def cost_model_from_args(a: argparse.Namespace):
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


def kv_link_from_args(a: argparse.Namespace) -> float:
    """--kv-transfer-link's bytes/s (one direction): a link of the roofline's table (a NIC
    preset, or nvlink: the --hardware's own link), else a rate
    (:func:`sloserve.argtypes.parse_bandwidth`). ValueError: neither (naming both forms), or
    nvlink on hardware without one."""
    from sloserve.argtypes import parse_bandwidth
    from sloserve.roofline.hardware import get_hardware, get_link
    hw = get_hardware(a.hardware)
    if a.kv_transfer_link in ("nvlink", "scale-up") and hw.link is None:
        raise ValueError(f"--hardware {a.hardware} has no scale-up link for --kv-transfer-link "
                         f"{a.kv_transfer_link}; use a NIC (nic-100g, nic-200g, nic-400g)")
    try:
        return get_link(a.kv_transfer_link, hw).bandwidth
    except KeyError as e:
        unknown = e.args[0]
    try:
        return parse_bandwidth(a.kv_transfer_link)
    except ValueError as e:
        raise ValueError(f"--kv-transfer-link: {unknown}; as a rate: {e}") from None


def disaggregation_from_args(a: argparse.Namespace):
    """The P/D setup of the flags, or None. KV size and layers from --kv-transfer-model, else
    --roofline-model, else SmolLM2-135M (the embedded model); KV per token split over --tp GPUs,
    each sending its share over its own link (:func:`kv_link_from_args`)."""
    p, d = a.num_prefill_instances, a.num_decode_instances
    if p is None and d is None:
        return None
    if p is None or d is None:
        raise ValueError("disaggregation needs both --num-prefill-instances and "
                         "--num-decode-instances")
    if a.num_replicas != 1:
        raise ValueError("--num-replicas is for colocated replicas; with disaggregation give "
                         "--num-prefill-instances and --num-decode-instances")
    from sloserve.roofline.kv import kv_bytes_per_token
    from sloserve.roofline.models import get_model
    from sloserve.sim.kv_transfer import Disaggregation, KVTransferModel
    spec = get_model(a.kv_transfer_model or a.roofline_model or "SmolLM2-135M")
    bandwidth = kv_link_from_args(a)
    kv = kv_bytes_per_token(spec, a.dtype)
    return Disaggregation(p, d, KVTransferModel(kv / a.tp, bandwidth, spec.num_layers,
                                                a.kv_transfer_mode, a.kv_transfer_latency_ms / 1e3))


def kv_blocks_from_args(a: argparse.Namespace) -> int:
    """--num-kv-blocks, else what --kv-cache-memory holds for the model whose KV the simulation
    stands for (--roofline-model in --dtype; else the embedded SmolLM2 in bf16); the lecture-70b
    preset: 90 % of tp x the GPU's memory minus the weights."""
    from sloserve.sim.capacity import kv_blocks, kv_blocks_after_weights
    if a.num_kv_blocks is not None:
        return a.num_kv_blocks
    if a.preset == "lecture-70b":
        return kv_blocks_after_weights(a.roofline_model, a.hardware, a.tp, a.dtype, a.block_size)
    if a.roofline_model:
        return kv_blocks(a.kv_cache_memory, a.roofline_model, a.dtype, a.block_size)
    return kv_blocks(a.kv_cache_memory, "SmolLM2-135M", "bf16", a.block_size)


class SimSetup:
    """A configured simulation: the workload, the engine settings, the cost model."""

    def __init__(self, a: argparse.Namespace):
        from sloserve.sim.simulator import SimConfig
        from sloserve.sim.workload import LengthOnlyFactory
        self.a = a
        self.slos = parse_goodput(a.goodput)
        self.shown = check_metric_flags(a)
        self.percentiles = tuple(a.metric_percentiles)
        check_workload_flags(a)
        self.cost, self.cost_name = cost_model_from_args(a)
        self.dis = disaggregation_from_args(a)
        self._dis: dict = {}  # (prefill, decode) -> Disaggregation, for run's layouts
        if a.dataset_name in ("sharegpt", "copy"):  # real texts: their lengths in tokens
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
        from sloserve.config import SpeculativeConfig
        self.spec = SpeculativeConfig.parse(a.speculative_config)  # ValueError names the key
        self.num_kv_blocks = kv_blocks_from_args(a)
        max_len = a.max_model_len or min(SIM_MODEL_LEN, self.num_kv_blocks * a.block_size)
        self.cfg = SimConfig(max_num_batched_tokens=a.max_num_batched_tokens,
                             max_num_seqs=a.max_num_seqs, max_model_len=max_len,
                             policy=batching_from_args(a),
                             queue_policy=a.scheduling_policy if a.scheduling_policy in QUEUE_POLICIES else "fcfs",
                             enable_prefix_caching=a.enable_prefix_caching,
                             max_waiting_requests=a.max_waiting_requests,
                             ttft_slo_s=a.ttft_slo_ms / 1e3 if a.ttft_slo_ms else None,
                             slo_deferral=a.slo_admission == "defer" and bool(a.ttft_slo_ms),
                             slo_reject=a.slo_admission == "reject" and bool(a.ttft_slo_ms),
                             long_prefill_token_threshold=a.long_prefill_token_threshold,
                             enable_prefill_pacing=a.enable_prefill_pacing,
                             num_kv_blocks=self.num_kv_blocks,
                             block_size=a.block_size, request_in_s=into, token_out_s=out,
                             speculative=self.spec,
                             spec_acceptance_rate=a.spec_acceptance_rate or 0.0, seed=a.seed)
        defaulted = getattr(self.cost, "defaulted", ())
        if self.spec is not None and "draft_tokens" in defaulted:
            self.cost_name += (", verify tokens priced as prefill tokens and no dense-GEMM "
                               "crossover (the profile has no verify terms)")
        if into or out:
            self.cost_name += (f", server path {1e3 * into:.1f} ms in / {1e3 * out:.1f} ms out")

    def arrivals(self, rate: float) -> list[float]:
        from sloserve.bench.arrivals import arrival_times
        if self.trace_arrivals:
            return [r.arrival_time or 0.0 for r in self.reqs]
        a = self.a
        return list(arrival_times(len(self.reqs), rate, process=arrival_process(a),
                                  burstiness=a.burstiness, seed=a.seed))

    def run(self, rate: float, cfg=None, replicas: int | None = None, prefill: int = 0,
            decode: int = 0):
        """(SimResult, BenchmarkMetrics) at ``rate`` req/s; ``replicas`` or ``prefill`` +
        ``decode`` instances instead of the flags' layout (``sloserve tune --instances``)."""
        from sloserve.sim.simulator import simulate_cluster
        a = self.a
        dis = self.dis
        if replicas is not None:
            dis = self._dis.get((prefill, decode)) if prefill else None
            if prefill and dis is None:
                ns = argparse.Namespace(**{**vars(a), "num_replicas": 1,
                                           "num_prefill_instances": prefill,
                                           "num_decode_instances": decode})
                dis = self._dis[(prefill, decode)] = disaggregation_from_args(ns)
        res = simulate_cluster(self.reqs, self.arrivals(rate), cfg or self.cfg, self.cost,
                               a.num_replicas if replicas is None else replicas, a.router,
                               max_concurrency=a.max_concurrency, disaggregation=dis)
        return res, calculate_metrics(res.records, res.duration, self.percentiles,
                                      goodput_slos=self.slos,
                                      start_time=0.0)

    def describe(self, cfg=None, where: str | None = None) -> str:
        """One line of what is simulated (``where``: the layout's words instead of the
        flags')."""
        a, cfg = self.a, cfg or self.cfg
        if where is None and self.dis:
            from sloserve.roofline.units import fmt_bandwidth
            where = (f"{self.dis.num_prefill} prefill + {self.dis.num_decode} decode instances "
                     f"(KV over {a.kv_transfer_link} at {fmt_bandwidth(self.dis.link.bandwidth)} "
                     f"per NIC, shared, {a.kv_transfer_mode})")
        elif where is None:
            where = f"{a.num_replicas} replica(s) ({a.router})"
        spec = ""
        if cfg.speculative is not None:
            spec = (f", {cfg.speculative.describe()}, modelled: draft acceptance "
                    f"{cfg.spec_acceptance_rate:g} per position")
        return (f"{len(self.reqs)} {a.dataset_name} requests, {where}, policy {cfg.policy}, "
                f"budget {cfg.max_num_batched_tokens}{spec}, cost model {self.cost_name}")


