"""KV-cache sizing: bytes per token, totals for B x S, per GPU under tensor parallelism.

Formulas (vLLM / PagedAttention, Kwon et al., SOSP 2023, sec. 2-3: the cache holds a K and a V
vector per head per layer per token):

- MHA / GQA / MQA: ``2 x layers x kv_heads x head_dim x bytes``
  (MHA: kv_heads = heads; MQA: kv_heads = 1; GQA in between). Llama-3-8B in fp16:
  2 x 32 x 8 x 128 x 2 = 131,072 B/token; Llama-3-70B: 2 x 80 x 8 x 128 x 2 = 327,680 B/token.
- MLA (DeepSeek-V2/V3): one compressed latent plus the shared RoPE key per layer, no factor 2:
  ``(kv_lora_rank + qk_rope_head_dim) x layers x bytes``; DeepSeek-V3 in bf16:
  (512 + 64) x 61 x 2 = 70,272 B/token.

The formula itself lives in :class:`sloserve.kv_cache_spec.KVCacheSpec`, which the engine sizes
its cache with too (an int8 cache adds a 4-byte scale per head entry there; fp8 and int4 are
counted without scales).

Under tensor parallelism KV heads are split across ranks; when TP exceeds the KV head count each
rank keeps (a replica of) one head, so the per-GPU share is ``ceil(kv_heads / tp)`` heads. The MLA
latent has no head axis and is replicated on every rank (as vLLM does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sloserve.kv_cache_spec import KVCacheSpec
from sloserve.roofline.models import ModelSpec

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of ``dtype`` (int4 = 0.5), weights, activations or KV."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def kv_cache_spec(spec: ModelSpec, kv_dtype: str = "fp16", block_size: int = 16) -> KVCacheSpec:
    """The KV cache spec of a model preset (``sloserve.kv_cache_spec``, the engine's one
    formula; an int8 cache counts its per-entry scale as the engine's does)."""
    if spec.mla is not None:
        return KVCacheSpec(block_size, 1, spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim,
                           kv_dtype, spec.num_layers, use_mla=True)
    return KVCacheSpec(block_size, spec.num_kv_heads, spec.head_dim, kv_dtype, spec.num_layers)


def kv_elems_per_token_per_layer(spec: ModelSpec) -> int:
    """Cached elements per token per layer: 2 x kv_heads x head_dim, or MLA's latent + RoPE key."""
    if spec.mla is not None:
        return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim
    return 2 * spec.num_kv_heads * spec.head_dim


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str = "fp16") -> float:
    """KV-cache bytes per token over all layers (see module docstring)."""
    return kv_cache_spec(spec, kv_dtype).bytes_per_token


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
