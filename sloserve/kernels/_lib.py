"""The kernels' shared library as ctypes sees it: the C API's signatures (``csrc/kernels.cpp``),
the C structs the fused layer reads, the environment switches, and opening a library.

``$SLOSERVE_KERNEL_ISA`` (:data:`ISA_ENV`) forces a variant (``avx512``, ``avx2``, ``generic``) or
turns the kernels off (``none``), see :func:`sloserve.kernels.loader.load`; ``$SLOSERVE_AMX=0``
(:data:`AMX_ENV`) keeps the AMX GEMM and attention off.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ISA_ENV = "SLOSERVE_KERNEL_ISA"
AMX_ENV = "SLOSERVE_AMX"
#: the libraries build.py makes, best first
VARIANTS = ("avx512", "avx2", "generic")
#: C API function -> (argument types, result type), as declared in csrc/kernels.cpp
_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGS = {
    "sl_isa": ([], _I32),
    "sl_num_threads": ([], _I32),
    "sl_set_num_threads": ([_I32], None),
    "sl_qlinear": ([_P, _I64, _I64, _P, _P, _P, _I32, _I32, _I64, _P, _P], _I32),
    "sl_qlinear_i8": ([_P, _I64, _I64, _P, _P, _P, _I32, _I32, _I64, _P, _P], _I32),
    "sl_repack_x16": ([_P, _P, _P, _I64, _I64, _I32, _I32, _P], _I32),
    "sl_qlinear_x16": ([_P, _I64, _P, _P, _P], None),
    "sl_qlinear_x16_swiglu": ([_P, _I64, _P, _P, _P], None),
    "sl_x16_layer_tail": ([_P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P], None),
    "sl_qembed": ([_P, _I64, _P, _P, _P, _I32, _I32, _I64, _P], _I32),
    "sl_rms_norm": ([_P, _P, _I64, _I64, _F, _P, _I32], None),
    "sl_add_rms_norm": ([_P, _P, _P, _I64, _I64, _F, _P, _I32, _I32], None),
    "sl_silu_mul": ([_P, _I64, _I64, _P, _I32], None),
    "sl_rope": ([_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64], None),
    "sl_cache_write": ([_P, _I64, _P, _I64, _P, _I32, _P, _I64, _I64, _I64, _I64], None),
    "sl_amx_init": ([], _I32),
    "sl_amx_pack_bf16": ([_P, _I64, _I64, _P], _I32),
    "sl_amx_linear": ([_P, _I64, _I64, _P, _I64, _P, _P], _I32),
    "sl_amx_swiglu": ([_P, _I64, _I64, _P, _I64, _P, _P], _I32),
    "sl_avx512_bf16": ([], _I32),
    "sl_prefill_attn_scratch": ([_I64, _I64, _I64, _I64], _I64),
    "sl_prefill_attn": ([_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F, _P,
                         _P, _I32, _I32], _I32),
    "sl_paged_attn_decode": ([_P, _I64, _P, _I32, _P, _I64, _P, _I64, _I64, _I64, _I64, _I64,
                              _I64, _F, _I64, _I64, _P, _P], None),
}


class _SlX16(ctypes.Structure):
    """The C side's ``SlX16``: an x16 weight's records, format (bits, offsets or not, float16
    scales or not) and shape."""
    _fields_ = [("qw", _P), ("bits", _I64), ("mins", _I64), ("sc16", _I64), ("N", _I64),
                ("K", _I64)]


class _SlX16Layer(ctypes.Structure):
    """The C side's ``SlX16Layer``: a layer's constant part for ``sl_x16_layer_tail``."""
    _fields_ = [("wo", _P), ("wgu", _P), ("wd", _P), ("ln2", _P), ("ln1n", _P), ("wqkv", _P),
                ("bias", _P), ("Hq", _I64), ("Hk", _I64), ("D", _I64), ("eps", _F)]


def open_library(path: str) -> ctypes.CDLL:
    """The library at ``path`` with every C API function's argument and result types set.

    Raises:
        OSError: it cannot be loaded; AttributeError: it lacks a function of the C API.
    """
    lib = ctypes.CDLL(path)
    for name, (args, res) in _SIGS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def _ptr(t: torch.Tensor) -> int:
    """A tensor's data pointer, for the C functions."""
    return t.data_ptr()
