"""Attention backends over the paged KV cache (see ``backend.py`` for the seam).

Importing this package registers the built-in backends.
"""
from sloserve.model.attention.backend import (AttentionBackend, StepInputs, available_backends,
                                              get_attention_backend, register_backend)
from sloserve.model.attention.torch_ref import TorchReferenceBackend
from sloserve.model.attention.cpu_paged import CpuPagedBackend

__all__ = ["AttentionBackend", "CpuPagedBackend", "StepInputs", "TorchReferenceBackend",
           "available_backends", "get_attention_backend", "register_backend"]
