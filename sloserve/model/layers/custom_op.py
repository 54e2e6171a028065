"""The native / kernel dispatch of an op (vLLM's ``CustomOp``)."""
from __future__ import annotations

from torch import nn


class CustomOp(nn.Module):
    """An op with a torch reference (:meth:`forward_native`) and an implementation on the
    project's CPU kernels (:meth:`forward_kernel`). It runs the reference until
    :meth:`use_kernels` hands it the kernels (the choice is made once, at model build: every
    op on the reference with ``--enforce-eager`` or where the kernels do not load)."""

    def __init__(self):
        super().__init__()
        #: the loaded ``sloserve.kernels.Kernels`` this op runs on, or None (torch reference)
        self.kernels = None
        self.forward = self.forward_native

    def __call__(self, *args, **kwargs):
        # without nn.Module's hook machinery (none is used): a step calls each op per layer
        return self.forward(*args, **kwargs)

    def use_kernels(self, kernels) -> None:
        """Run on ``kernels`` from now on (None: back to the torch reference)."""
        self.kernels = kernels
        self.forward = self.forward_native if kernels is None else self.forward_kernel

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_kernel(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
