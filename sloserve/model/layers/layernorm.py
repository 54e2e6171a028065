"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in front of it."""
from __future__ import annotations

import torch
from torch import nn

from sloserve.model.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """y = x / sqrt(mean(x^2) + eps) * weight.

    Called as ``norm(x)`` or ``norm(delta, residual)`` (vLLM's fused add): the latter adds
    ``delta`` to the residual stream first and returns ``(norm(residual + delta), residual +
    delta)``; the former returns ``(norm(x), x)``, ``x`` becoming the residual stream.

    Native: in x's dtype (the normalization computed in float32). Kernels: the residual stream
    is float32 and is updated in place; the output is in ``out_dtype`` (float32 or bfloat16).
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_f32: torch.Tensor | None = None  # the kernels' copy

    def use_kernels(self, kernels) -> None:
        super().use_kernels(kernels)
        self.weight_f32 = (self.weight.detach().float().contiguous()
                           if kernels is not None else None)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None):
        if residual is not None:
            x = residual + x
        return self._norm(x), x

    def forward_kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                       out_dtype: torch.dtype = torch.float32):
        k = self.kernels
        if residual is None:
            return k.rms_norm(x, self.weight_f32, self.eps, out_dtype), x
        return k.add_rms_norm(residual, x, self.weight_f32, self.eps, out_dtype), residual
