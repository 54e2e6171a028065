"""SiLU-and-mul: silu(gate) * up of a fused gate/up product (Shazeer 2020's SwiGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sloserve.model.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """x [T, 2F] (gate columns, then up) -> silu(gate) * up [T, F], x's dtype."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(x)  # float32 or bfloat16
