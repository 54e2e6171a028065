"""Model specs for the roofline: presets, Hugging Face ``config.json``, GGUF.

A :class:`ModelSpec` holds the shapes the FLOP/byte formulas need (elements, not bytes): layers,
width, query heads, KV heads, head dim, MLP width, vocab; plus :class:`MLASpec` (DeepSeek-V2/V3
multi-head latent attention, DeepSeek-V3 tech report, arXiv:2412.19437, sec. 2.1.1) and
:class:`MoESpec` (routed + shared experts) where the model has them.

Llama/Mistral/Qwen2 configs go through :meth:`sloserve.model.config.ModelConfig.from_hf_dict`;
DeepSeek configs are read here. A GGUF goes through :func:`sloserve.model.gguf_loader.read_gguf` and
:func:`~sloserve.model.gguf_loader.gguf_to_config` (imported lazily: that module imports torch);
its parameter count is the exact sum over the tensor table.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention dims (elements).

    Attributes:
        q_lora_rank: rank of the query down-projection (0 = no query compression).
        kv_lora_rank: compressed KV latent c_KV, cached per token per layer (512 in V3).
        qk_rope_head_dim: decoupled RoPE key, shared by all heads, cached too (64 in V3).
        qk_nope_head_dim: per-head non-RoPE query/key dim (128 in V3).
        v_head_dim: per-head value dim (128 in V3).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts MLP.

    Attributes:
        n_routed_experts: routed experts per MoE layer.
        n_shared_experts: always-active experts per MoE layer.
        experts_per_token: routed experts each token uses (top-k).
        moe_intermediate_size: SwiGLU width of one expert (elements).
        first_k_dense: the first k layers use the dense MLP (``intermediate_size``) instead.
    """

    n_routed_experts: int
    n_shared_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    first_k_dense: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer (all in elements).

    ``nominal_params`` is the marketing size (e.g. 70e9 for "70B"), used by the textbook
    shortcuts (weights = params x bytes); :meth:`num_params` counts the actual matrices.
    ``exact_params`` (from a GGUF tensor table) overrides the count when present.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mla: MLASpec | None = None
    moe: MoESpec | None = None
    nominal_params: float | None = None
    exact_params: int | None = None

    @property
    def attention_kind(self) -> str:
        """``"MLA"``, ``"MHA"`` (kv == q heads), ``"MQA"`` (one KV head) or ``"GQA"``."""
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    # ---- parameter counts (elements); the matrices of Llama-style / DeepSeek blocks ----
    def attn_params(self) -> int:
        """Attention weights of one layer (projections; biases included)."""
        h, H = self.hidden_size, self.num_heads
        if self.mla is not None:
            m = self.mla
            q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
                 if m.q_lora_rank else h * H * (m.qk_nope_head_dim + m.qk_rope_head_dim))
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank \
                + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + H * m.v_head_dim * h
        qkv_out = (H + 2 * self.num_kv_heads) * self.head_dim
        return h * qkv_out + (qkv_out if self.attention_bias else 0) + H * self.head_dim * h

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.first_k_dense

    def mlp_params(self, layer: int) -> int:
        """MLP weights of layer ``layer`` (SwiGLU: gate, up, down; MoE: all experts + router)."""
        h = self.hidden_size
        if self.is_moe_layer(layer):
            m = self.moe
            return (m.n_routed_experts + m.n_shared_experts) * 3 * h * m.moe_intermediate_size \
                + h * m.n_routed_experts
        return 3 * h * self.intermediate_size

    def num_params(self) -> int:
        """Total parameters (elements): embeddings, blocks, norms, LM head (if untied)."""
        if self.exact_params:
            return self.exact_params
        h = self.hidden_size
        blocks = sum(self.attn_params() + self.mlp_params(i) + 2 * h for i in range(self.num_layers))
        return self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + blocks + h

    def active_params(self) -> int:
        """Parameters one token touches (MoE: shared + top-k experts only)."""
        total = self.num_params()
        if self.moe is None:
            return total
        m, h = self.moe, self.hidden_size
        idle = (m.n_routed_experts - m.experts_per_token) * 3 * h * m.moe_intermediate_size
        return total - idle * (self.num_layers - m.first_k_dense)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(attention_kind=self.attention_kind, num_params=self.num_params(),
                 active_params=self.active_params())
        return d


PRESETS: dict[str, ModelSpec] = {
    "Llama-3-8B": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, nominal_params=8e9),
    "Llama-3-70B": ModelSpec("Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256, nominal_params=70e9),
    "Qwen2.5-7B": ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, attention_bias=True,
                            nominal_params=7e9),
    "Mistral-7B": ModelSpec("Mistral-7B", 32, 4096, 32, 8, 128, 14336, 32000, nominal_params=7e9),
    "SmolLM2-135M": ModelSpec("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True,
                              nominal_params=135e6),
    "DeepSeek-V3": ModelSpec(
        "DeepSeek-V3", 61, 7168, 128, 128, 192, 18432, 129280,
        mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128),
        moe=MoESpec(n_routed_experts=256, n_shared_experts=1, experts_per_token=8,
                    moe_intermediate_size=2048, first_k_dense=3),
        nominal_params=671e9),
}


def list_models() -> list[str]:
    return list(PRESETS)


def get_model(name_or_path: str) -> ModelSpec:
    """A preset name (case-insensitive), a ``config.json`` (or a folder holding one), or a ``.gguf``.

    Raises:
        KeyError: neither a preset nor an existing path.
        ValueError: the file cannot be parsed into a spec.
    """
    for k, spec in PRESETS.items():
        if k.lower() == name_or_path.lower():
            return spec
    p = name_or_path
    if os.path.isdir(p) and os.path.isfile(os.path.join(p, "config.json")):
        p = os.path.join(p, "config.json")
    if os.path.isfile(p):
        if p.endswith(".gguf"):
            return spec_from_gguf(p)
        with open(p) as f:
            return spec_from_hf_config(json.load(f), name=os.path.basename(os.path.dirname(os.path.abspath(p))))
    raise KeyError(f"unknown model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                   f"nor a config.json / .gguf path")


def spec_from_hf_config(cfg: dict[str, Any], name: str = "config.json") -> ModelSpec:
    """Build from a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, DeepSeek-V2/V3)."""
    if cfg.get("model_type") in ("deepseek_v2", "deepseek_v3") or "kv_lora_rank" in cfg:
        return _spec_from_deepseek(cfg, name)
    from sloserve.model.config import ModelConfig

    mc = ModelConfig.from_hf_dict(cfg)
    return ModelSpec(name, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads,
                     mc.num_key_value_heads, mc.head_dim, mc.intermediate_size, mc.vocab_size,
                     tie_word_embeddings=mc.tie_word_embeddings, attention_bias=mc.attention_bias)


def _spec_from_deepseek(cfg: dict[str, Any], name: str) -> ModelSpec:
    try:
        mla = MLASpec(int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]),
                      int(cfg["qk_rope_head_dim"]), int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"]))
        moe = None
        if cfg.get("n_routed_experts"):
            moe = MoESpec(int(cfg["n_routed_experts"]), int(cfg.get("n_shared_experts") or 0),
                          int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                          int(cfg.get("first_k_dense_replace") or 0))
        H = int(cfg["num_attention_heads"])
        return ModelSpec(name, int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), H,
                         int(cfg.get("num_key_value_heads") or H),
                         mla.qk_nope_head_dim + mla.qk_rope_head_dim, int(cfg["intermediate_size"]),
                         int(cfg["vocab_size"]), bool(cfg.get("tie_word_embeddings", False)),
                         mla=mla, moe=moe)
    except KeyError as e:
        raise ValueError(f"DeepSeek config: missing {e.args[0]}") from e


def spec_from_gguf(path: str) -> ModelSpec:
    """Build from a GGUF's metadata (``gguf_to_config``); params = exact tensor-table element count."""
    from sloserve.model.gguf_loader import gguf_model_name, gguf_to_config, read_gguf

    gf = read_gguf(path)
    mc = gguf_to_config(gf)
    n = sum(math.prod(t.shape) for t in gf.tensors.values() if t.name != "rope_freqs.weight")
    return ModelSpec(gguf_model_name(gf) or os.path.basename(path), mc.num_hidden_layers, mc.hidden_size,
                     mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size,
                     mc.vocab_size, tie_word_embeddings=mc.tie_word_embeddings,
                     attention_bias=mc.attention_bias, exact_params=n)
