"""KV-cache sizing: bytes per token, totals for B x S, per GPU under tensor parallelism.

Formulas (vLLM / PagedAttention, Kwon et al., SOSP 2023, sec. 2-3: the cache holds a K and a V
vector per head per layer per token):

- MHA / GQA / MQA: ``2 x layers x kv_heads x head_dim x bytes``
  (MHA: kv_heads = heads; MQA: kv_heads = 1; GQA in between). Llama-3-8B in fp16:
  2 x 32 x 8 x 128 x 2 = 131,072 B/token; Llama-3-70B: 2 x 80 x 8 x 128 x 2 = 327,680 B/token.
- MLA (DeepSeek-V2/V3): one compressed latent plus the shared RoPE key per layer, no factor 2:
  ``(kv_lora_rank + qk_rope_head_dim) x layers x bytes``; DeepSeek-V3 in bf16:
  (512 + 64) x 61 x 2 = 70,272 B/token.

Under tensor parallelism KV heads are split across ranks; when TP exceeds the KV head count each
rank keeps (a replica of) one head, so the per-GPU share is ``ceil(kv_heads / tp)`` heads. The MLA
latent has no head axis and is replicated on every rank (as vLLM does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sloserve.roofline.models import ModelSpec

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (int4 = 0.5; scales/zero-points of quantized caches ignored)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def gqa_kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                           elem_bytes: float) -> float:
    """KV bytes per token of MHA/GQA/MQA: 2 x layers x kv_heads x head_dim x bytes (the one
    formula; the engine sizes its cache with it too)."""
    return 2 * num_layers * num_kv_heads * head_dim * elem_bytes


def blocks_that_fit(memory_bytes: float, bytes_per_token: float, block_size: int) -> int:
    """Whole KV blocks of ``block_size`` tokens in ``memory_bytes`` (the engine's and the
    simulator's cache sizing)."""
    return int(memory_bytes // (bytes_per_token * block_size))


def kv_elems_per_token_per_layer(spec: ModelSpec) -> int:
    """Cached elements per token per layer: 2 x kv_heads x head_dim, or MLA's latent + RoPE key."""
    if spec.mla is not None:
        return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    return 2 * spec.num_kv_heads * spec.head_dim


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "fp16") -> float:
    """KV-cache bytes per token over all layers (see module docstring)."""
    if spec.mla is None:
        return gqa_kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                      dtype_bytes(kv_dtype))
    return kv_elems_per_token_per_layer(spec) * spec.num_layers * dtype_bytes(kv_dtype)


def kv_bytes_per_token_per_gpu(spec: ModelSpec, kv_dtype: str = "fp16", tp: int = 1) -> float:
    """Per-GPU share under TP: ``ceil(kv_heads / tp)`` heads per rank; MLA latent replicated."""
    full = kv_bytes_per_token(spec, kv_dtype)
    if spec.mla is not None or tp <= 1:
        return full
    return full * math.ceil(spec.num_kv_heads / tp) / spec.num_kv_heads


@dataclass(frozen=True)
class KVFootprint:
    """KV cache of ``batch`` sequences of ``seq_len`` tokens. Bytes."""

    kind: str
    kv_dtype: str
    bytes_per_token: float
    batch: int
    seq_len: int
    tp: int
    total_bytes: float
    per_gpu_bytes: float


def kv_footprint(spec: ModelSpec, batch: int, seq_len: int, kv_dtype: str = "fp16",
                 tp: int = 1) -> KVFootprint:
    """Total KV for ``batch x seq_len`` tokens and the per-GPU share at tensor parallelism ``tp``.

    Llama-3-70B, 128 x 4096 tokens, fp16: 327,680 x 524,288 = 160 GiB; 20 GiB per GPU at TP=8.
    """
    per_tok = kv_bytes_per_token(spec, kv_dtype)
    n = batch * seq_len
    return KVFootprint(spec.attention_kind, kv_dtype, per_tok, batch, seq_len, tp, per_tok * n,
                       kv_bytes_per_token_per_gpu(spec, kv_dtype, tp) * n)
