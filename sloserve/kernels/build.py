"""Build the CPU kernels (``csrc/``) into one shared library per instruction set.

Plain ``g++ -O3 -shared -fopenmp``: no torch headers, a few seconds per variant. The sources are
one translation unit: ``csrc/kernels.cpp`` (the C API) includes every part (``csrc/*.h``: threads,
quantized products, x16 layout, elementwise ops, KV cache, decode and prefill attention, AMX GEMM,
the fused layer) once, and only it is compiled. This "unity" build keeps the code the compiler
generates what it was when the kernels were one file: the hot loops' helpers (tile bodies, vector
math) stay visible to, and inlined into, their callers in other parts, with no link-time
optimization and no exported internal symbols.

The kernels split their work with OpenMP, so they share torch's OpenMP runtime (torch loads its
``libgomp.so.1`` first; ours resolves to it) and its threads instead of a second pool fighting it
for the cores: measured over 40 steps (min/median), a 16-request decode step took a median
44-52 ms with OpenMP against 62-64 ms with the library's own pool (batch 1: same within noise).
Without ``-DSL_USE_OMP`` the source builds the pool variant (``csrc/parallel.h``).

Libraries go to ``$SLOSERVE_KERNEL_DIR`` or ``~/.cache/sloserve/kernels``, named by the hash of
every source and header and the flags, so an edited source is rebuilt and an unchanged one never
is.

    python -c 'from sloserve.kernels.build import main; main()'   # what `make` runs after installing

(not ``python -m sloserve.kernels.build``: the package imports this module first, and runpy then
warns that it finds it in ``sys.modules``.)
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
#: the translation unit g++ compiles (it includes every other source)
SRC = os.path.join(CSRC, "kernels.cpp")
#: instruction-set variant -> g++ flags
VARIANTS: dict[str, list[str]] = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma",
               "-mf16c", "-mavx2"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
COMMON = ["-O3", "-std=c++17", "-pthread", "-fPIC", "-shared", "-fno-math-errno",
          "-ffp-contract=off",  # d * q + m rounds as torch rounds it (explicit FMAs stay)
          "-fopenmp", "-DSL_USE_OMP",  # torch's OpenMP threads (see above)
          "-Wall"]


class KernelBuildError(RuntimeError):
    """The compiler is missing or failed (the message holds its first lines of output)."""


def kernel_dir() -> str:
    return os.environ.get("SLOSERVE_KERNEL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sloserve", "kernels")


def sources() -> list[str]:
    """Every source and header of the library (``csrc/*.cpp``, ``csrc/*.h``), sorted."""
    return sorted(os.path.join(CSRC, n) for n in os.listdir(CSRC)
                  if n.endswith((".cpp", ".h")))


def library_path(variant: str) -> str:
    """Where ``variant``'s library is (or will be) for the current source and flags."""
    h = hashlib.sha256()
    for path in sources():
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(COMMON + VARIANTS[variant]).encode())
    return os.path.join(kernel_dir(), f"libsloserve_{variant}_{h.hexdigest()[:12]}.so")


def build(variant: str, force: bool = False) -> str:
    """Compile ``variant`` unless its library exists; returns the library path.

    Raises:
        KernelBuildError: no C++ compiler, or the compile failed.
    """
    out = library_path(variant)
    if os.path.exists(out) and not force:
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise KernelBuildError("no C++ compiler (g++) on PATH")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    cmd = [cxx, *COMMON, *VARIANTS[variant], SRC, "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        msg = (r.stderr or r.stdout).strip().splitlines()[:5]
        raise KernelBuildError(f"{' '.join(cmd[:2])} ... failed: " + " | ".join(msg))
    os.replace(tmp, out)  # atomic: a concurrent builder never loads half a file
    return out


def main(argv: list[str] | None = None) -> int:
    """Build every variant this machine can build; prints where each went."""
    import platform
    variants = ["generic"] + (["avx2", "avx512"] if platform.machine() in ("x86_64", "AMD64")
                              else [])
    rc = 0
    for v in variants:
        try:
            print(f"sloserve kernels: {v}: {build(v)}")
        except KernelBuildError as e:
            print(f"sloserve kernels: {v}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
