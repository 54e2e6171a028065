"""The roofline of one engine step of any composition (decodes, their draft tokens and prefill
chunks together): ``max(FLOP / peak, bytes / bandwidth)`` (Williams et al. 2009). The
simulator's roofline cost model prices steps with it and the dashboard draws it beside each
served step's time.

FLOP and bytes come from :func:`sloserve.roofline.ops.operator_costs`: the weights are read
once per step whatever it carries (or ``weight_bytes``, the bytes the engine really reads:
quantized weights are smaller than any dtype's); every query token pays the linear layers'
FLOP, activations and KV write; the LM head runs once per sequence of the step (decodes and
chunks); attention pays per query-key pair and reads each KV token once
(``sloserve.step_io.attention_work``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.roofline.hardware import Hardware
from sloserve.roofline.models import ModelSpec
from sloserve.roofline.ops import Workload, operator_costs


@dataclass
class StepRoofline:
    """Args:
        spec, hw: the model and the machine.
        dtype: weight / activation / KV dtype name (``bf16``, ``fp8``...), for the bytes of
            each and the peak (``hw.peak(dtype)``).
        weight_bytes: bytes of weights a step reads, when not the spec's at ``dtype``.
        kv_dtype: the KV cache's dtype, when not ``dtype``.
        peak: FLOP/s, when not ``hw.peak(dtype)``.
        bandwidth: bytes/s, when not ``hw.mem_bandwidth``.

    :meth:`observe` raises the peak or the bandwidth to a rate a real step reached (a
    measurement that under-reads the machine, e.g. a matmul peak below the engine's int8
    kernels, must not put the bound above a step that beat it).
    """

    spec: ModelSpec
    hw: Hardware
    dtype: str = "bf16"
    weight_bytes: float | None = None
    kv_dtype: str | None = None
    peak: float | None = None
    bandwidth: float | None = None
    per: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        kv = self.kv_dtype or self.dtype

        def ops(ctx: int) -> dict:
            return {o.name: o for o in operator_costs(
                self.spec, Workload("decode", 1, ctx, self.dtype, self.dtype, kv))}
        one, two = ops(1), ops(2)
        body = [o for n, o in one.items() if n not in ("attention", "lm_head")]
        self.per = {
            "weights": (self.weight_bytes if self.weight_bytes is not None
                        else sum(o.weight_bytes for o in one.values())),
            "token_flops": sum(o.flops for o in body),
            "head_flops": one["lm_head"].flops,
            "token_act_bytes": sum(o.act_bytes for n, o in one.items() if n != "lm_head"),
            "head_act_bytes": one["lm_head"].act_bytes,
            "pair_flops": two["attention"].flops - one["attention"].flops,
            "kv_token_bytes": two["attention"].kv_bytes - one["attention"].kv_bytes,
            "kv_write_bytes": one["qkv_proj"].kv_bytes,
        }
        if self.peak is None:
            self.peak = self.hw.peak(self.dtype)
        if self.bandwidth is None:
            self.bandwidth = self.hw.mem_bandwidth
        #: the measured roofs, before any step raised them
        self.measured = (self.peak, self.bandwidth)

    def flops_bytes(self, tokens: int, sequences: int, pairs: int,
                    kv_tokens: int) -> tuple[float, float]:
        """(FLOP, bytes) of a step of ``tokens`` query tokens in ``sequences`` sequences,
        ``pairs`` attention pairs and ``kv_tokens`` KV tokens read."""
        p = self.per
        flops = tokens * p["token_flops"] + sequences * p["head_flops"] + pairs * p["pair_flops"]
        nbytes = (p["weights"] + tokens * (p["token_act_bytes"] + p["kv_write_bytes"])
                  + sequences * p["head_act_bytes"] + kv_tokens * p["kv_token_bytes"])
        return flops, nbytes

    def seconds(self, tokens: int, sequences: int, pairs: int, kv_tokens: int) -> float:
        """The step's bound: no step of this composition runs faster on ``hw``."""
        flops, nbytes = self.flops_bytes(tokens, sequences, pairs, kv_tokens)
        return max(flops / self.peak, nbytes / self.bandwidth)

    def observe(self, tokens: int, sequences: int, pairs: int, kv_tokens: int,
                seconds: float) -> float:
        """A step that took ``seconds``: a roof it beat is raised to the rate it reached (the
        FLOP or the bytes it must have done in that time); returns its bound after that."""
        flops, nbytes = self.flops_bytes(tokens, sequences, pairs, kv_tokens)
        if seconds > 0:
            self.peak = max(self.peak, flops / seconds)
            self.bandwidth = max(self.bandwidth, nbytes / seconds)
        return max(flops / self.peak, nbytes / self.bandwidth)


#: the engine's dtype names -> the calculator's
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8",
           "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def served_roofline(shape: dict, dtype: str, kv_dtype: str,
                    hw: Hardware | None = None) -> StepRoofline | None:
    """The roofline of the served model's steps (``EngineInfo.model_shape``, the engine's
    dtype and KV dtype) on ``hw``, by default this machine's cached measurement
    (``hardware.cached_local``; None when there is none, or no shape): its bandwidth and the
    fastest of its measured peaks, so that no step can beat it."""
    from sloserve.roofline.hardware import cached_local

    hw = hw if hw is not None else cached_local()
    if hw is None or not shape.get("num_hidden_layers"):
        return None
    heads = shape["num_attention_heads"]
    spec = ModelSpec("served", shape["num_hidden_layers"], shape["hidden_size"], heads,
                     shape.get("num_key_value_heads") or heads,
                     shape.get("head_dim") or shape["hidden_size"] // heads,
                     shape["intermediate_size"], shape["vocab_size"],
                     tie_word_embeddings=bool(shape.get("tie_word_embeddings")),
                     attention_bias=bool(shape.get("attention_bias")))
    act = _DTYPES.get(dtype, "bf16")
    return StepRoofline(spec, hw, act, weight_bytes=shape.get("weight_bytes") or None,
                        kv_dtype=_DTYPES.get(kv_dtype, act), peak=max(hw.peak_flops.values()))
