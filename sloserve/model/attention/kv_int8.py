"""The int8 KV cache format (``--kv-cache-dtype int8``): one head's K (or V) of one token is D
int8 codes followed by a float32 scale, 4 bytes, so an entry is D + 4 bytes (68 for D = 64,
against 128 in bf16 and 256 in float32).

scale = max |x| / 127 over the entry, code = x / scale rounded to nearest even, value = code *
scale: the error of a value is at most scale / 2, i.e. 1/254 of the entry's largest magnitude
(symmetric absmax quantization per head and token, like llama.cpp's ``q8_0`` cache with one
group per head). An all-zero entry has scale 0; an entry holding a NaN has scale NaN, so it
reads back as NaN, as a float cache would.

Rounding to 8 bits amplifies last-bit differences: a value that lands near a rounding boundary
takes the neighbouring code when the K/V it came from differs by one ulp (the fast path's matmul
kernel depends on the step's token count), so greedy output over an int8 cache is not exactly
reproducible across batching and prefix-cache hits even in a float32 engine (README, Numerics).

The CPU kernels (``kv_quantize`` in ``sloserve/kernels/csrc/kernels.cpp``) compute the same
codes; this module is the torch version for the reference backend, the prefill path that
reads a dequantized copy, and the tests. The cache tensor is ``torch.int8`` shaped
``[2, num_blocks, block_size, H_kv, D + 4]``.
"""
from __future__ import annotations

import torch

from sloserve.kv_cache_spec import INT8_SCALE_BYTES

#: bytes after an entry's D codes: its float32 scale (the KV cache spec's figure)
SCALE_BYTES = INT8_SCALE_BYTES


def entry_width(head_dim: int, kv_cache_dtype: torch.dtype) -> int:
    """Elements of one head's entry in a cache of this dtype: D, or D + 4 for int8."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 [..., D + 4] entries (codes, then the scale's bytes)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    nan = x.isnan().any(dim=-1, keepdim=True)
    scale = torch.where(nan, torch.full_like(amax, float("nan")), amax / 127.0)
    codes = torch.where(scale > 0, torch.round(x / scale), torch.zeros_like(x))
    codes = codes.clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize(entries: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 [..., D + 4] entries -> [..., D] values in ``dtype`` (computed in float32)."""
    d = entries.shape[-1] - SCALE_BYTES
    scale = entries[..., d:].contiguous().view(torch.float32)
    return (entries[..., :d].float() * scale).to(dtype)

