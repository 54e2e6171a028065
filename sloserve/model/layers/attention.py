"""Attention over the paged KV cache: the step's attention backend (``sloserve.model.attention``:
the torch reference or the kernels' paged decode / prefill) writes K/V and attends."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Attention(nn.Module):
    """Multi-head / grouped-query attention (Ainslie et al. 2023) of q [T, H, D], k/v
    [T, H_kv, D] -> [T, H * D] in the attention backend's output dtype."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                backend, meta: Any) -> torch.Tensor:
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return o.reshape(q.shape[0], self.num_heads * self.head_dim)

    #: called without nn.Module's hook machinery (none is used): a step calls it per layer
    __call__ = forward
