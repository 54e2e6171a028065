"""Which kernel library this process uses, and loading it: :func:`load`.

:func:`load` picks the library: AVX-512 (F/BW/VL/DQ + VNNI + FMA) where the CPU has it, else
AVX2/FMA, else the generic build; ``$SLOSERVE_KERNEL_ISA=avx512|avx2|generic`` forces one (an
AVX-512 machine exercises the AVX2 path this way), ``none`` turns the kernels off. A library
missing for the current source is built first (``build.py``, a few seconds). ``load()`` returns
None when no library can be built or loaded: the engine then runs its torch path and says so.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from sloserve.kernels._lib import ISA_ENV, VARIANTS
from sloserve.kernels.build import KernelBuildError, build
from sloserve.kernels.ops import Kernels

logger = logging.getLogger(__name__)


def best_variant(flags) -> str:
    """The library for a CPU with these /proc/cpuinfo flags."""
    f = set(flags)
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "fma"} <= f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return "generic"


@functools.lru_cache(maxsize=None)
def load(variant: str | None = None) -> Kernels | None:
    """The kernels for this CPU (or ``variant``, or ``$SLOSERVE_KERNEL_ISA``); None when they
    are turned off (``none``) or cannot be built or loaded (logged once)."""
    from sloserve.platform import detect_cpu
    want = variant or os.environ.get(ISA_ENV) or best_variant(detect_cpu().flags)
    if want == "none":
        return None
    if want not in VARIANTS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join((*VARIANTS, 'none'))}, got {want!r}")
    try:
        k = Kernels(build(want), want)
    except (KernelBuildError, OSError) as e:
        logger.warning("CPU kernels unavailable (%s); the engine uses its torch path", e)
        return None
    k.set_num_threads(torch.get_num_threads())
    return k
