"""Rotary position embedding (RoPE, Su et al. 2021) in Hugging Face's rotate_half layout."""
from __future__ import annotations

import math

import torch

from sloserve.model.config import ModelConfig
from sloserve.model.layers.custom_op import CustomOp


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) of RoPE, with scaling.

    Supports rope_scaling None/"default", "linear" (positions divided by factor) and "llama3"
    (Llama 3.1's frequency-dependent scaling: wavelengths above original_max/low_freq_factor are
    divided by `factor`, below original_max/high_freq_factor kept, smooth in between).

    Raises:
        ValueError: an unsupported rope_type.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(rs.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(rs.get("low_freq_factor", 1.0))
        high = float(rs.get("high_freq_factor", 4.0))
        old_ctx = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(CustomOp):
    """RoPE with angles computed from the step's positions once per forward pass (position x
    inverse frequency in float32, as transformers computes them): no table, no longest position
    to size in advance.

    ``rope(positions, dtype)`` -> the step's tables; ``rope.rotate(q, k, tables)`` -> rotated
    (q, k). Native: cos/sin [T, 1, D] in the model's dtype, new tensors. Kernels: cos/sin
    [T, D / 2] float32, q and k (float32 views) rotated in place.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(config).float().contiguous()
        #: kernels, --batch-invariant: the tables of each position computed once and looked up
        #: (``sloserve.model.invariant.RopeTableCache``); None: computed per step
        self.table_cache = None

    def forward_native(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward_kernel(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32):
        if self.table_cache is not None:
            return self.table_cache(positions)
        return self.kernels.rope_tables(positions, self.inv_freq)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, tables):
        """Rotate q [T, H, D] and k [T, H_kv, D] by this step's ``tables``."""
        cos, sin = tables
        if self.kernels is not None:
            self.kernels.rope(q, k, cos, sin)
            return q, k
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
