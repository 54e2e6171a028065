"""The quantized GGUF-block linear method on the project's kernels.

A layer's parts (:class:`~sloserve.model.quant.QuantizedWeight`, one per part of a fused
layer) are fused into one weight where their formats agree (one product for Q/K/V, one for
gate/up). With int8 activations (every dtype but ``--dtype float32``: the input quantized to
int8 per group of 32 and multiplied with integer dot products, ~1.4x faster, as llama.cpp
does) 4- and 8-bit group-32 weights go to the kernels' x16 layout (16 rows per integer dot
product; 1.5-3.5x faster than the row layout at 1-5 tokens), a gate/up weight interleaved for
the fused SiLU-and-mul epilogue; other weights, and every weight with float32 activations (the
weights' exact values times exact activations), use the row layout (``qlinear_i8`` /
``qlinear``).
"""
from __future__ import annotations

import torch

from sloserve.kernels import X16Weight
from sloserve.model.quant import QuantizedWeight, concat_rows


class GGUFLinearMethod:
    """``weights``: the layer's quantized weight(s) as the kernels take them (one fused weight,
    or one per part where their formats differ). Outputs float32 (plus the layer's float32
    bias)."""

    def __init__(self, kernels, weights: list, int8_activations: bool):
        self.k, self.weights, self.int8_activations = kernels, weights, int8_activations

    @classmethod
    def create(cls, kernels, parts: list[QuantizedWeight], int8_activations: bool,
               swiglu: bool = False) -> "GGUFLinearMethod":
        """Fuse ``parts`` where they agree and pack them (see the module docstring); ``swiglu``:
        the parts are gate and up, packed for the fused epilogue where the kernels can."""
        fused = parts[0] if len(parts) == 1 else concat_rows(parts)
        ws = [fused] if fused is not None else list(parts)
        if int8_activations:
            if swiglu and len(ws) == 1:
                ws = [kernels.pack_x16_swiglu(ws[0]) or kernels.pack_x16(ws[0]) or ws[0]]
            else:
                ws = [kernels.pack_x16(w) or w for w in ws]
        return cls(kernels, ws, int8_activations)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.weights)

    def describe(self) -> str:
        """The weights' formats as the products take them (e.g. ``x16:4b+mins+f16:swiglu``,
        int8 or float32 activations): what decides this method's speed beside the shape."""
        def one(w) -> str:
            if isinstance(w, X16Weight):
                return w.format
            return f"g{w.group_size}:{w.bits}b{'+mins' if w.has_mins else ''}"
        return ",".join(map(one, self.weights)) + (":i8" if self.int8_activations else ":f32")

    @property
    def fused_swiglu(self) -> bool:
        """One weight packed for the fused SiLU-and-mul epilogue."""
        return len(self.weights) == 1 and getattr(self.weights[0], "swiglu", False)

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T on one quantized weight (for a weight packed for the fused SwiGLU:
        silu(gate) * up, [T, intermediate])."""
        if isinstance(w, X16Weight):
            return self.k.qlinear_x16_swiglu(x, w) if w.swiglu else self.k.qlinear_x16(x, w)
        if self.int8_activations and w.group_size == 32:
            return self.k.qlinear_i8(x, w)
        return self.k.qlinear(x, w)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        ws = self.weights
        y = self.linear(x, ws[0]) if len(ws) == 1 else \
            torch.cat([self.linear(x, w) for w in ws], dim=1)
        if layer.bias_f32 is not None:
            y += layer.bias_f32
        return y

    def swiglu(self, layer, x: torch.Tensor, act_fn) -> torch.Tensor:
        """silu(gate) * up [T, F] float32: one fused product where the weight is packed for it,
        else the product then ``act_fn``."""
        if self.fused_swiglu:
            return self.linear(x, self.weights[0])
        return act_fn(self.apply(layer, x))
