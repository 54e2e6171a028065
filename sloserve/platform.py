"""The CPU this process runs on: its instruction sets, and the dtype the engine computes in there.

The CPU kind varies between machines: some expose AVX-512 with bf16 (AVX512_BF16, AMX), others
only AVX2/FMA, where torch's bfloat16 matmul is emulated and runs 10-200x slower than float32.
So the engine never assumes an instruction set: with
``--dtype auto`` (the default) it times one small bfloat16 and one float32 product of each shape
that matters (a prefill-shaped GEMM and a decode-shaped GEMV) in this process, under whatever caps
``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` set, and computes in bfloat16 only where that is
not slower than float32 for the GEMM (and not more than 2x per GEMV, which moves half the
bytes); the KV cache follows (``--kv-cache-dtype auto``). The choice,
with the ISA flags and the probe's ratios, is one log line (:meth:`DtypeChoice.describe`).

An AVX-512 machine exercises the AVX2 choice with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2``.

The log line also says how many compute threads the engine runs and why
(``sloserve.cpus.cpu_budget``).
"""
from __future__ import annotations

import functools
import os
import platform as _platform
import time
from dataclasses import dataclass

from sloserve.config import DTYPE_CHOICES as DTYPES
from sloserve.config import KV_CACHE_DTYPE_CHOICES as KV_CACHE_DTYPES
from sloserve.cpus import CpuBudget

#: ISA flags of /proc/cpuinfo that decide which kernels are fast, in the order they are shown
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
#: ``auto`` picks bfloat16 when its GEMM takes at most this multiple of float32's time (native
#: bf16: ~0.5x; emulated: 9x under the AVX2 caps on an AMX machine, ~200x on an AVX2-only host) ...
BF16_MAX_GEMM_RATIO = 1.0
#: ... and its GEMV at most this multiple (bf16 moves half the bytes, so up to 2x per product is
#: no loss once the weights stream from memory; the AVX2-only host's bf16 GEMV was ~3x slower)
BF16_MAX_GEMV_RATIO = 2.0


@dataclass(frozen=True)
class CpuInfo:
    """What the CPU offers.

    Attributes:
        model_name: /proc/cpuinfo ``model name`` (or ``platform.processor()``).
        flags: the :data:`ISA_FLAGS` present, in that order.
        aten_capability: torch's vectorized-kernel level (``AVX512``, ``AVX2``, ``DEFAULT``, ...),
            after ``ATEN_CPU_CAPABILITY``.
        onednn_max_isa: ``ONEDNN_MAX_CPU_ISA`` if set (caps oneDNN's kernels, torch's bf16 GEMMs).
        num_threads: torch intra-op threads.
        budget: how the engine chose its thread count (None: not chosen, torch's default).
    """

    model_name: str
    flags: tuple[str, ...]
    aten_capability: str
    onednn_max_isa: str | None
    num_threads: int
    budget: CpuBudget | None = None

    @property
    def has_native_bf16(self) -> bool:
        """The hardware has bf16 dot products (AVX512_BF16 or AMX-BF16); caps may still hide them."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line: model, ISA flags, torch/oneDNN caps, threads."""
        caps = f"ATen {self.aten_capability}"
        if self.onednn_max_isa:
            caps += f", ONEDNN_MAX_CPU_ISA={self.onednn_max_isa}"
        threads = (self.budget.describe() if self.budget is not None
                   else f"{self.num_threads} torch threads")
        return (f"{self.model_name}; ISA {' '.join(self.flags) or 'none of ' + '/'.join(ISA_FLAGS[:2])}; "
                f"{caps}; {threads}")


def _cpuinfo() -> tuple[str, set[str]]:
    name, flags = _platform.processor() or _platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in ("", _platform.machine(), _platform.processor()):
                    name = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return name, flags


def detect_cpu(budget: CpuBudget | None = None) -> CpuInfo:
    """Read the CPU's ISA flags and torch's caps (cheap; call after setting torch's threads);
    ``budget``: how the threads were chosen, for the log line."""
    import torch

    name, flags = _cpuinfo()
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "unknown"
    return CpuInfo(name, tuple(f for f in ISA_FLAGS if f in flags), cap,
                   os.environ.get("ONEDNN_MAX_CPU_ISA"), torch.get_num_threads(), budget)


@dataclass(frozen=True)
class MatmulProbe:
    """Best-of-N seconds of one product per dtype and shape (see :func:`probe_matmul`).

    Attributes:
        gemm_fp32_s, gemm_bf16_s: [32, 512] x [512, 512] (a prefill chunk's shape, compute-bound).
        gemv_fp32_s, gemv_bf16_s: [1, 1024] x [1024, 1024] (a decode step's shape).
    """

    gemm_fp32_s: float
    gemm_bf16_s: float
    gemv_fp32_s: float
    gemv_bf16_s: float

    @property
    def gemm_ratio(self) -> float:
        """bf16 time / fp32 time for the GEMM (< 1: bf16 faster)."""
        return self.gemm_bf16_s / self.gemm_fp32_s

    @property
    def gemv_ratio(self) -> float:
        return self.gemv_bf16_s / self.gemv_fp32_s


def probe_matmul(repeats: int = 20) -> MatmulProbe:
    """Time torch's linear in float32 and bfloat16 for a GEMM and a GEMV shape: best of
    ``repeats`` each, the two dtypes' calls alternated, on one thread (the ratio is the kernels'
    ISA, and one thread is not stalled by an OpenMP barrier when another process holds a core);
    a few ms where bf16 is native, up to ~0.5 s where it is emulated. torch's thread count is
    restored afterwards.

    Alternated because machines are shared: one dtype's runs back to back last well under a
    millisecond, so a neighbour's burst could cover all of them and flip the choice."""
    import torch

    def best_pair(m: int, k: int, n: int) -> tuple[float, float]:
        g = torch.Generator().manual_seed(0)
        args = {}
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k, generator=g).to(dtype)
            w = torch.randn(n, k, generator=g).to(dtype)
            torch.nn.functional.linear(x, w)  # first call: oneDNN primitive creation
            args[dtype] = (x, w)
        ts: dict = {torch.float32: [], torch.bfloat16: []}
        for _ in range(repeats):
            for dtype, (x, w) in args.items():
                t0 = time.perf_counter()
                torch.nn.functional.linear(x, w)
                ts[dtype].append(time.perf_counter() - t0)
        return max(min(ts[torch.float32]), 1e-9), max(min(ts[torch.bfloat16]), 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return MatmulProbe(*best_pair(32, 512, 512), *best_pair(1, 1024, 1024))
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the engine computes in (weights and activations) and stores KV in.

    Attributes:
        dtype: ``bfloat16``, ``float32`` or ``float16``.
        kv_cache_dtype: dtype of the paged KV cache.
        requested: what ``--dtype`` asked for (``auto`` or a dtype).
        reason: why, in words (with the probe's ratios where one ran).
        cpu: the CPU it was chosen for.
        probe: the probe's times (None when no probe ran).
    """

    dtype: str
    kv_cache_dtype: str
    requested: str
    reason: str
    cpu: CpuInfo
    probe: MatmulProbe | None = None

    def describe(self) -> str:
        """The one log line: CPU, ISA, caps, then the choice and why."""
        return (f"cpu: {self.cpu.describe()} -> dtype {self.dtype}, KV cache {self.kv_cache_dtype} "
                f"({self.reason})")


def decide_dtype(requested: str, probe: MatmulProbe | None) -> tuple[str, str]:
    """The dtype for ``requested`` given the probe (a pure function; tests call it directly).

    ``auto``: bfloat16 when its GEMM takes at most :data:`BF16_MAX_GEMM_RATIO` x float32's time
    and its GEMV at most :data:`BF16_MAX_GEMV_RATIO` x, else float32. An explicit dtype is kept; the
    reason then warns when the probe found bf16/fp16 math emulated.

    Returns:
        (dtype, reason).

    Raises:
        ValueError: ``requested`` is not one of :data:`DTYPES`, or ``auto`` without a probe.
    """
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    ratios = (f"bf16/fp32 time: GEMM {probe.gemm_ratio:.2f}x, GEMV {probe.gemv_ratio:.2f}x"
              if probe is not None else "")
    native = (probe is not None and probe.gemm_ratio <= BF16_MAX_GEMM_RATIO
              and probe.gemv_ratio <= BF16_MAX_GEMV_RATIO)
    if requested == "auto":
        if probe is None:
            raise ValueError("dtype 'auto' needs a matmul probe")
        if native:
            return "bfloat16", f"auto: bf16 matmul is native here, {ratios}"
        return "float32", f"auto: bf16 matmul is emulated here, {ratios}; float32 avoids the cliff"
    if requested == "bfloat16" and probe is not None and not native:
        return requested, (f"as requested, but bf16 matmul is emulated here ({ratios}): "
                           f"expect prefill far slower than with --dtype float32")
    return requested, "as requested" + (f" ({ratios})" if ratios else "")


@functools.lru_cache(maxsize=None)
def _cached_probe() -> MatmulProbe:
    return probe_matmul()


def choose_dtype(requested: str = "auto", kv_cache_dtype: str = "auto",
                 budget: CpuBudget | None = None) -> DtypeChoice:
    """Resolve ``--dtype`` / ``--kv-cache-dtype`` for this CPU (probes once per process; no
    probe for ``float32``); ``budget``: the thread choice, for the log line.

    Raises:
        ValueError: an unknown dtype.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    cpu = detect_cpu(budget)
    probe = None if requested == "float32" else _cached_probe()
    dtype, reason = decide_dtype(requested, probe)
    kv = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    return DtypeChoice(dtype, kv, requested, reason, cpu, probe)
