"""One call that computes everything ``sloserve roofline`` prints (the Python API).

:func:`plan` takes a model spec, a hardware entry and the workload knobs, and returns a
:class:`Plan`: balance point, prefill and decode analyses (per-operator and per GPU under tensor
parallelism), KV sizes, lower bounds, capacity and KV transfer. Under TP the FLOPs, weight and
activation bytes are split evenly across ranks and the KV share follows :mod:`.kv`
(inter-GPU all-reduce traffic is not counted).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sloserve.roofline import bounds
from sloserve.roofline.hardware import Hardware, Link
from sloserve.roofline.kv import dtype_bytes, kv_bytes_per_token, kv_bytes_per_token_per_gpu, kv_footprint
from sloserve.roofline.models import ModelSpec
from sloserve.roofline.ops import StepAnalysis, Workload, analyze
from sloserve.roofline.roofline import RooflinePoint, roofline_point
from sloserve.roofline.units import GiB

CAPACITY_CONTEXTS = (1024, 4096, 16384, 32768, 131072)


@dataclass
class Plan:
    """Everything for one (model, hardware, workload). Bytes in B, times in s, rates per s."""

    model: dict
    hardware: dict
    dtype: str
    tp: int
    balance: float
    prefill: StepAnalysis
    decode: StepAnalysis
    prefill_per_gpu: RooflinePoint
    decode_per_gpu: RooflinePoint
    kv_bytes_per_token: dict[str, float]
    kv_total: dict
    weight_bytes: float
    weight_bytes_per_gpu: float
    prefill_seconds: float
    decode_step_seconds: float
    decode_bound: bounds.DecodeBound | None = None
    memory_budget_per_gpu: float = 0.0
    reserve_bytes: float = 0.0
    max_batch: dict[int, int] = field(default_factory=dict)
    transfers: dict[str, bounds.KVTransfer] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("model", "hardware", "dtype", "tp", "balance",
                                           "kv_bytes_per_token", "kv_total", "weight_bytes",
                                           "weight_bytes_per_gpu", "prefill_seconds",
                                           "decode_step_seconds", "memory_budget_per_gpu",
                                           "reserve_bytes", "notes")}
        d["prefill"] = self.prefill.to_dict()
        d["decode"] = self.decode.to_dict()
        d["prefill_per_gpu"] = self.prefill_per_gpu.to_dict()
        d["decode_per_gpu"] = self.decode_per_gpu.to_dict()
        d["decode_bound"] = asdict(self.decode_bound)
        d["max_batch"] = {str(k): v for k, v in self.max_batch.items()}
        d["transfers"] = {k: v.to_dict() for k, v in self.transfers.items()}
        return d


def _per_gpu(a: StepAnalysis, tp: int, kv_share: float, hw: Hardware, dtype: str) -> RooflinePoint:
    flops = a.flops / tp
    nbytes = sum(o.weight_bytes + o.act_bytes for o in a.ops) / tp + sum(o.kv_bytes for o in a.ops) * kv_share
    return roofline_point(flops, nbytes, hw, dtype)


def plan(spec: ModelSpec, hw: Hardware, *, batch: int = 1, prompt_len: int = 1024,
         context_len: int = 4096, prefill_batch: int = 1, weight_dtype: str = "bf16",
         kv_dtype: str | None = None, tp: int = 1, memory_efficiency: float = 1.0,
         compute_efficiency: float = 1.0, memory_fraction: float = 0.9, reserve_gib: float = 0.0,
         links: dict[str, Link] | None = None) -> Plan:
    """Compute the whole report (see module docstring). ``batch``/``context_len``: the decode step;
    ``prefill_batch``/``prompt_len``: the prefill step; ``memory_fraction`` of each GPU's memory is
    the budget, minus ``reserve_gib`` GiB (activations, CUDA graphs, fragmentation)."""
    kv_dtype = kv_dtype or weight_dtype
    notes: list[str] = []
    dtype = "bf16" if weight_dtype == "int4" else weight_dtype
    try:
        hw.peak(dtype)
    except KeyError:
        notes.append(f"{hw.name} has no {dtype} peak; using fp32 ({', '.join(hw.peak_flops)} known)")
        dtype = "fp32"
    act = "bf16"
    pre = analyze(spec, Workload("prefill", prefill_batch, prompt_len, weight_dtype, act, kv_dtype), hw, dtype)
    dec = analyze(spec, Workload("decode", batch, context_len, weight_dtype, act, kv_dtype), hw, dtype)
    kv_share = kv_bytes_per_token_per_gpu(spec, kv_dtype, tp) / kv_bytes_per_token(spec, kv_dtype)
    pre_g = _per_gpu(pre, tp, kv_share, hw, dtype)
    dec_g = _per_gpu(dec, tp, kv_share, hw, dtype)
    peak, bw = hw.peak(dtype), hw.mem_bandwidth
    t_pre = bounds.step_time(pre_g.flops, pre_g.bytes, peak, bw, compute_efficiency, memory_efficiency)
    t_dec = bounds.step_time(dec_g.flops, dec_g.bytes, peak, bw, compute_efficiency, memory_efficiency)
    w = spec.num_params() * dtype_bytes(weight_dtype)
    budget = hw.mem_bytes * memory_fraction
    reserve = reserve_gib * GiB
    kv_tok_gpu = kv_bytes_per_token_per_gpu(spec, kv_dtype, tp)
    mb = {s: bounds.max_batch(budget, w / tp, kv_tok_gpu * s, reserve) for s in
          sorted({*CAPACITY_CONTEXTS, context_len})}
    if spec.moe is not None:
        notes.append("MoE: weights counted in full for capacity; per-step bytes count touched experts")
    transfers = {}
    kv_prompt = kv_bytes_per_token(spec, kv_dtype) * prompt_len * prefill_batch
    for name, link in (links or {}).items():
        transfers[name] = bounds.kv_transfer(kv_prompt, link.bandwidth, t_pre, spec.num_layers)
    fp = kv_footprint(spec, batch, context_len, kv_dtype, tp)
    return Plan(
        model=spec.to_dict(), hardware=hw.to_dict(), dtype=dtype, tp=tp,
        balance=hw.balance_point(dtype), prefill=pre, decode=dec, prefill_per_gpu=pre_g,
        decode_per_gpu=dec_g,
        kv_bytes_per_token={d: kv_bytes_per_token(spec, d) for d in ("bf16", "fp8", "int4")},
        kv_total=asdict(fp), weight_bytes=w, weight_bytes_per_gpu=w / tp, prefill_seconds=t_pre,
        decode_step_seconds=t_dec, decode_bound=bounds.decode_bound(t_dec, batch),
        memory_budget_per_gpu=budget, reserve_bytes=reserve, max_batch=mb, transfers=transfers,
        notes=notes)
