"""The project's CPU kernels (C++, ``csrc/``) through ctypes, for the instruction set this CPU has.

``load()`` gives the :class:`Kernels` of this CPU's library (built first if missing), or None
when the kernels are off or cannot be built (the engine then runs its torch path). The package:

- ``loader``: which library (``best_variant``, ``$SLOSERVE_KERNEL_ISA``) and :func:`load`;
- ``_lib``: the C API's ctypes signatures and structs, opening a library;
- ``ops``: :class:`Kernels`, one method per op (products, norms, RoPE, attention, ...);
- ``packing``: the packed weight types (:class:`X16Weight`, :class:`X16Layer`,
  :class:`AmxWeight`) and the ``pack_*`` functions behind ``Kernels.pack_*``;
- ``build``: compiling ``csrc/kernels.cpp`` into one shared library per instruction set.
"""
from __future__ import annotations

from sloserve.kernels._lib import AMX_ENV, ISA_ENV, VARIANTS
# the C API's signatures, as before the split (A/B scripts under benchmarks/results import it)
from sloserve.kernels._lib import _SIGS  # noqa: F401
from sloserve.kernels.build import KernelBuildError, build
from sloserve.kernels.loader import best_variant, load
from sloserve.kernels.ops import Kernels
from sloserve.kernels.packing import AmxWeight, X16Layer, X16Weight

__all__ = ["AMX_ENV", "ISA_ENV", "VARIANTS", "AmxWeight", "KernelBuildError", "Kernels",
           "X16Layer", "X16Weight", "best_variant", "build", "load"]
