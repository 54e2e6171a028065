"""Per-operator FLOPs and bytes of one prefill or decode step (LLM-Viewer style).

Breakdown after LLM-Viewer (Yuan et al., "LLM Inference Unveiled: Survey and Roofline Model
Insights", arXiv:2402.16363): each operator loads its weights, loads its input activations and stores
its outputs; attention also reads the KV cache. Operators, summed over all layers: ``qkv_proj``
(incl. writing the new K/V into the cache), ``attention`` (QK^T, softmax, PV; fused, i.e. the score
matrix stays on chip as in FlashAttention), ``o_proj``, ``mlp`` (SwiGLU: 3 matrices; MoE: router +
shared + routed experts), ``lm_head`` (logits for the last position of each sequence only, as
serving engines compute). Norms, RoPE, residual adds and the embedding gather are left out
(< 1% of either count for these models).

Counting conventions: a matmul of ``m x k`` by ``k x n`` is ``2 m k n`` FLOP. Attention over
``pairs`` (query, key) pairs is ``2 x pairs x heads x (d_qk + d_v)`` FLOP: decode has ``batch x
context`` pairs (each new token sees the whole context, itself included); a prefill of ``T`` tokens
with a causal mask has ``batch x T(T+1)/2``. Decode reads the whole context's KV from memory; a
fused prefill reads the prompt's KV once.

MLA: prefill uses the naive form (per-head K/V rebuilt from the latent: d_qk = nope + rope,
d_v = v_head_dim); decode uses the weight-absorbed form (attention over the cached latent:
d_qk = kv_lora_rank + rope, d_v = kv_lora_rank), as in the DeepSeek-V2 paper sec. 2.1.3.
MoE weight bytes count the distinct experts a step touches under uniform routing:
``E x (1 - (1 - k/E)**n_tokens)`` (an expectation; real routers are skewed).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sloserve.roofline.hardware import Hardware
from sloserve.roofline.kv import dtype_bytes, kv_elems_per_token_per_layer
from sloserve.roofline.models import ModelSpec
from sloserve.roofline.roofline import RooflinePoint, roofline_point


@dataclass(frozen=True)
class Workload:
    """One engine step.

    Attributes:
        phase: ``"prefill"`` or ``"decode"``.
        batch: sequences in the step.
        seq_len: prefill: prompt tokens per sequence; decode: context length (tokens in the cache
            after this step, the new one included).
        weight_dtype / act_dtype / kv_dtype: storage dtypes (``fp16``, ``bf16``, ``fp8``, ``int4``...).
    """

    phase: str
    batch: int
    seq_len: int
    weight_dtype: str = "bf16"
    act_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be prefill or decode, got {self.phase!r}")
        if self.batch < 1 or self.seq_len < 1:
            raise ValueError("batch and seq_len must be >= 1")

    @property
    def new_tokens(self) -> int:
        """Tokens run through the weights this step."""
        return self.batch * (self.seq_len if self.phase == "prefill" else 1)


@dataclass(frozen=True)
class OpCost:
    """One operator summed over layers. FLOP and bytes (weights, activations, KV cache)."""

    name: str
    flops: float
    weight_bytes: float
    act_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOP/byte."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes": self.bytes, "intensity": self.intensity}


@dataclass(frozen=True)
class StepAnalysis:
    """A step's per-operator costs and its place on the roofline."""

    workload: Workload
    ops: list[OpCost]
    point: RooflinePoint
    op_points: dict[str, RooflinePoint] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return self.point.flops

    @property
    def bytes(self) -> float:
        return self.point.bytes

    def to_dict(self) -> dict:
        return {"workload": asdict(self.workload), "ops": [o.to_dict() for o in self.ops],
                "total": self.point.to_dict(),
                "op_roofline": {k: v.to_dict() for k, v in self.op_points.items()}}


def operator_costs(spec: ModelSpec, wl: Workload) -> list[OpCost]:
    """FLOPs and bytes of each operator for ``wl`` (see module docstring for the formulas)."""
    wb, ab, kvb = dtype_bytes(wl.weight_dtype), dtype_bytes(wl.act_dtype), dtype_bytes(wl.kv_dtype)
    L, h, H, B, n = spec.num_layers, spec.hidden_size, spec.num_heads, wl.batch, wl.new_tokens
    kv_el = kv_elems_per_token_per_layer(spec)
    decode = wl.phase == "decode"
    if spec.mla is not None:
        m = spec.mla
        d_v_out = m.v_head_dim
        o_w = H * m.v_head_dim * h
        qkv_w = spec.attn_params() - o_w
        qkv_out = H * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.kv_lora_rank + m.qk_rope_head_dim
        d_qk, d_v = ((m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank) if decode
                     else (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim))
    else:
        d = spec.head_dim
        qkv_out = (H + 2 * spec.num_kv_heads) * d
        qkv_w = h * qkv_out
        o_w = H * d * h
        d_qk = d_v = d_v_out = d
    pairs = B * wl.seq_len if decode else B * wl.seq_len * (wl.seq_len + 1) // 2
    kv_read_tokens = B * wl.seq_len  # decode: whole context; prefill: the prompt, read once (fused)

    ops = [
        OpCost("qkv_proj", L * 2 * n * qkv_w, L * qkv_w * wb, L * n * (h + qkv_out) * ab,
               L * n * kv_el * kvb),
        OpCost("attention", L * 2 * pairs * H * (d_qk + d_v), 0.0,
               L * n * H * (d_qk + d_v_out) * ab, L * kv_read_tokens * kv_el * kvb),
        OpCost("o_proj", L * 2 * n * o_w, L * o_w * wb, L * n * (H * d_v_out + h) * ab, 0.0),
    ]
    n_moe = sum(spec.is_moe_layer(i) for i in range(L))
    n_dense = L - n_moe
    I = spec.intermediate_size
    mlp_f = n_dense * 2 * n * 3 * h * I
    mlp_w = n_dense * 3 * h * I * wb
    mlp_a = n_dense * n * (2 * h + 3 * I) * ab
    if n_moe:
        mo = spec.moe
        E, k, mI = mo.n_routed_experts, mo.experts_per_token, mo.moe_intermediate_size
        touched = E * (1 - (1 - k / E) ** n) + mo.n_shared_experts
        mlp_f += n_moe * (2 * n * 3 * h * mI * (k + mo.n_shared_experts) + 2 * n * h * E)
        mlp_w += n_moe * (3 * h * mI * touched + h * E) * wb
        mlp_a += n_moe * n * (2 * h + 3 * mI * (k + mo.n_shared_experts)) * ab
    ops.append(OpCost("mlp", mlp_f, mlp_w, mlp_a, 0.0))
    V = spec.vocab_size
    ops.append(OpCost("lm_head", 2 * B * h * V, h * V * wb, B * (h + V) * ab, 0.0))
    return ops


def analyze(spec: ModelSpec, wl: Workload, hw: Hardware, dtype: str | None = None) -> StepAnalysis:
    """Per-operator costs of ``wl`` and the step's roofline point on ``hw``.

    ``dtype`` picks the peak (default: the weight dtype, fp16/bf16 -> the 16-bit tensor rate;
    int4 weights fall back to the 16-bit rate, since they are dequantized before the matmul).
    """
    ops = operator_costs(spec, wl)
    dtype = dtype or ("bf16" if wl.weight_dtype == "int4" else wl.weight_dtype)
    flops = sum(o.flops for o in ops)
    nbytes = sum(o.bytes for o in ops)
    return StepAnalysis(wl, ops, roofline_point(flops, nbytes, hw, dtype),
                        {o.name: roofline_point(o.flops, o.bytes, hw, dtype) for o in ops})
