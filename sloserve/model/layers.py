"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP."""
from __future__ import annotations

import math

import torch
from torch import nn

from sloserve.model.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich 2019).

    Shapes: x [T, d] -> [T, d], same dtype as x.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) of RoPE (Su et al. 2021), with scaling.

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


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021) in Hugging Face's rotate_half layout.

    cos/sin are computed from the step's positions once per forward pass (angle = position x
    inverse frequency in float32, as transformers computes them), so there is no table and no
    longest position to size in advance.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(config)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, 1, head_dim] in ``dtype``."""
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotate q [T, H, D] and k [T, H_kv, D] by (cos, sin) from :meth:`cos_sin`."""
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020). [T, d] -> [T, d]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
