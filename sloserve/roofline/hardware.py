"""Accelerator table (peak FLOP/s per dtype, memory bandwidth and size, interconnect) and ``local``.

Roofline inputs after Williams, Waterman & Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 52(4), 2009: a machine is its peak compute rate
(FLOP/s) and its peak memory bandwidth (bytes/s).

All figures are *dense* (no 2:4 sparsity), vendor datasheet peaks, decimal units:
FLOP/s in 10**12 (TFLOP/s), bandwidth in 10**12 bytes/s (TB/s). ``fp32`` is the non-tensor-core
FP32 rate on NVIDIA parts (TF32 is listed separately); ``int8`` is in OP/s. Interconnect bandwidths
are per direction (NVLink's "900 GB/s" is 450 GB/s each way); NIC presets are 100/200/400 Gbit/s.

``local`` is this machine's CPU measured on the spot (the read bandwidth a decode step attains:
every thread reading a buffer far larger than the last-level cache with torch; STREAM's Copy with
numpy where torch is missing; fp32 and bf16 matmul peaks = 2 n**3 FLOP / best time with torch,
the engine's own kernels, or fp32 only with numpy) and cached as JSON under
``~/.cache/sloserve/`` (``--remeasure`` refreshes it).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass

from sloserve.roofline.units import GB, GBPS_NET, TB, TFLOPS, GiB


@dataclass(frozen=True)
class Link:
    """An interconnect. ``bandwidth``: bytes/s in one direction."""

    name: str
    bandwidth: float
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    """One accelerator.

    Attributes:
        name: table key, e.g. ``"H100-SXM"``.
        peak_flops: dtype -> dense peak FLOP/s (int8: OP/s). Keys among fp32, tf32, bf16, fp16,
            fp8, int8.
        mem_bandwidth: peak memory bandwidth, bytes/s.
        mem_bytes: memory capacity, bytes (see ``mem_note`` for the vendor's unit).
        link: the scale-up interconnect (NVLink, Infinity Fabric, PCIe), per direction.
        source: where the numbers come from.
        mem_note: how the capacity was quoted.
    """

    name: str
    peak_flops: dict[str, float]
    mem_bandwidth: float
    mem_bytes: float
    link: Link | None = None
    source: str = ""
    mem_note: str = ""

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype`` (fp16 and bf16 are interchangeable aliases).

        Raises:
            KeyError: the part has no such rate (e.g. fp8 on A100).
        """
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        alias = {"fp16": "bf16", "bf16": "fp16"}.get(dtype)
        if alias in self.peak_flops:
            return self.peak_flops[alias]
        raise KeyError(f"{self.name} has no {dtype} peak; has {', '.join(self.peak_flops)}")

    def balance_point(self, dtype: str = "bf16") -> float:
        """Machine balance (ridge point), FLOP/byte = peak FLOP/s / bandwidth (Williams et al.)."""
        return self.peak(dtype) / self.mem_bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


NIC_PRESETS: dict[str, Link] = {
    f"nic-{g}g": Link(f"{g} Gbit/s NIC", g * GBPS_NET, "line rate, one direction")
    for g in (100, 200, 400)
}

_NV = "NVIDIA datasheet"
HARDWARE: dict[str, Hardware] = {
    "A100-SXM-80GB": Hardware(
        "A100-SXM-80GB",
        {"fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS,
         "int8": 624 * TFLOPS},
        2.039 * TB, 80 * GiB, Link("NVLink 3 (600 GB/s total)", 300 * GB, _NV),
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), dense", "80 GB HBM2e = 81,920 MiB"),
    "H100-SXM": Hardware(
        "H100-SXM",
        {"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS, "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS,
         "fp8": 1979 * TFLOPS, "int8": 1979 * TFLOPS},
        3.35 * TB, 80 * GiB, Link("NVLink 4 (900 GB/s total)", 450 * GB, _NV),
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5), dense (989.4 quoted as 989)",
        "80 GB HBM3 (binary)"),
    "H200-SXM": Hardware(
        "H200-SXM",
        {"fp32": 67 * TFLOPS, "tf32": 494.5 * TFLOPS, "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS,
         "fp8": 1979 * TFLOPS, "int8": 1979 * TFLOPS},
        4.8 * TB, 141 * GB, Link("NVLink 4 (900 GB/s total)", 450 * GB, _NV),
        "NVIDIA H200 Tensor Core GPU datasheet (SXM), dense", "141 GB HBM3e (vendor, decimal)"),
    "B200": Hardware(
        "B200",
        {"fp32": 75 * TFLOPS, "tf32": 1125 * TFLOPS, "bf16": 2250 * TFLOPS, "fp16": 2250 * TFLOPS,
         "fp8": 4500 * TFLOPS, "int8": 4500 * TFLOPS},
        8 * TB, 180 * GB, Link("NVLink 5 (1.8 TB/s total)", 900 * GB, _NV),
        "NVIDIA HGX B200 datasheet (8-GPU sparse figures / 8 / 2), dense", "180 GB HBM3e (vendor)"),
    "L40S": Hardware(
        "L40S",
        {"fp32": 91.6 * TFLOPS, "tf32": 183 * TFLOPS, "bf16": 362.05 * TFLOPS,
         "fp16": 362.05 * TFLOPS, "fp8": 733 * TFLOPS, "int8": 733 * TFLOPS},
        0.864 * TB, 48 * GiB, Link("PCIe Gen4 x16", 32 * GB, "PCI-SIG, one direction"),
        "NVIDIA L40S datasheet, dense", "48 GB GDDR6 (binary)"),
    "MI300X": Hardware(
        "MI300X",
        {"fp32": 163.4 * TFLOPS, "tf32": 653.7 * TFLOPS, "bf16": 1307.4 * TFLOPS,
         "fp16": 1307.4 * TFLOPS, "fp8": 2614.9 * TFLOPS, "int8": 2614.9 * TFLOPS},
        5.3 * TB, 192 * GiB, Link("Infinity Fabric (896 GB/s total)", 448 * GB, "AMD datasheet"),
        "AMD Instinct MI300X datasheet, dense", "192 GB HBM3 (binary)"),
}

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sloserve", "roofline_local.json")


def list_hardware() -> list[str]:
    """Names accepted by :func:`get_hardware` (``local`` included)."""
    return [*HARDWARE, "local"]


def get_hardware(name: str, cache_path: str | None = None, remeasure: bool = False) -> Hardware:
    """Look up a table entry (case-insensitive) or measure/load ``local``.

    Raises:
        KeyError: unknown name.
    """
    if name.lower() == "local":
        return measure_local(cache_path or DEFAULT_CACHE, remeasure=remeasure)
    for k, hw in HARDWARE.items():
        if k.lower() == name.lower():
            return hw
    raise KeyError(f"unknown hardware {name!r}; known: {', '.join(list_hardware())}")


def get_link(name: str, hw: Hardware | None = None) -> Link:
    """``nic-100g`` / ``nic-200g`` / ``nic-400g``, or ``nvlink`` (the hardware's own link)."""
    if name in NIC_PRESETS:
        return NIC_PRESETS[name]
    if name in ("nvlink", "scale-up") and hw is not None and hw.link is not None:
        return hw.link
    raise KeyError(f"unknown link {name!r}; known: {', '.join([*NIC_PRESETS, 'nvlink'])}")


def _local_key() -> dict:
    return {"machine": platform.machine(), "node": platform.node(), "cpus": os.cpu_count(),
            "probe": "read-v2"}  # a cache from the one-thread copy probe is measured again


def cached_local(cache_path: str = DEFAULT_CACHE) -> Hardware | None:
    """This machine's measurement cached by ``sloserve roofline --hardware local --measure``
    (None when there is none for this machine): measures nothing."""
    if not os.path.isfile(cache_path):
        return None
    try:
        with open(cache_path) as f:
            d = json.load(f)
        return _local_from_dict(d) if d.get("key") == _local_key() else None
    except (OSError, ValueError, KeyError):
        return None


def measure_local(cache_path: str = DEFAULT_CACHE, remeasure: bool = False,
                  stream_bytes: int = 256 * 2**20, matmul_n: int = 1024, repeats: int = 5) -> Hardware:
    """Measure this CPU, or load the cached result.

    Bandwidth: :func:`_read_bandwidth` (without torch: best of ``repeats`` ``np.copyto`` of a
    ``stream_bytes`` float64 array, counted as 2 x ``stream_bytes`` moved, STREAM's "Copy"). Peaks: best of ``repeats``
    ``n x n @ n x n`` counted as 2 n**3 FLOP, in fp32 and bf16 with torch (the engine's kernels)
    when torch is installed, else fp32 with numpy. The result is written to ``cache_path`` (JSON).
    """
    import numpy as np

    key = _local_key()
    if not remeasure:
        cached = cached_local(cache_path)
        if cached is not None:
            return cached
    bw, bw_method = _read_bandwidth(repeats)
    if bw is None:  # no torch: STREAM's Copy with numpy, one thread
        n_el = stream_bytes // 8
        a, b = np.ones(n_el), np.empty(n_el)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t0)
        bw = 2 * n_el * 8 / best
        bw_method = f"numpy copyto {stream_bytes} B x{repeats}"
    peaks = _matmul_peaks(matmul_n, repeats)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    lib = "torch" if "bf16" in peaks else "numpy"
    d = {"key": key, **peaks, "mem_bandwidth": bw, "mem_bytes": mem,
         "method": f"{bw_method}; {lib} "
                   f"{'/'.join(sorted(peaks))} matmul n={matmul_n} x{repeats}",
         "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
    with open(cache_path, "w") as f:
        json.dump(d, f, indent=1)
    return _local_from_dict(d)


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0 (sysfs), 0 where unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    txt = f.read().strip()
            except OSError:
                continue
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(txt[-1:].upper(), 1)
            num = txt[:-1] if txt[-1:].isalpha() else txt
            if num.isdigit():
                best = max(best, int(num) * mult)
    except OSError:
        pass
    return best


class ReadProbe:
    """The read-bandwidth probe, kept for repeated passes: every torch thread summing (wide
    vector loads: torch vectorizes an int64 reduction) a buffer of at least 1 GiB and 8x the
    last-level cache, so nothing of it is cached, as a decode step reads its weights. (A
    one-thread copy reads ~0.7x of it on a Zen 4 host: a decode step then showed "149 %".)"""

    def __init__(self):
        import torch
        llc = last_level_cache_bytes()
        nbytes = max(2**30, 8 * llc)
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            nbytes = min(nbytes, max(mem // 4, 256 * 2**20))
        except (ValueError, OSError, AttributeError):
            pass
        self.buf = torch.ones(nbytes // 8, dtype=torch.int64)
        self.buf.sum()  # pages it in
        self.nbytes = nbytes // 8 * 8
        self.how = (f"torch int64 sum over {nbytes / 2**30:.2f} GiB ({torch.get_num_threads()} "
                    f"threads, last-level cache {llc / 2**20:.0f} MiB)")

    def once(self) -> float:
        """One pass: bytes/s."""
        t0 = time.perf_counter()
        self.buf.sum()
        return self.nbytes / (time.perf_counter() - t0)


def _read_bandwidth(repeats: int) -> tuple[float | None, str]:
    """Attainable read bandwidth: the best of ``repeats`` (at least 3) :class:`ReadProbe` passes.
    Returns (bytes/s, how) or (None, why) without torch."""
    try:
        probe = ReadProbe()
    except ImportError:
        return None, "no torch"
    n = max(repeats, 3)
    best = max(probe.once() for _ in range(n))
    return best, f"{probe.how} x{n}"


def _matmul_peaks(n: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` n x n @ n x n FLOP/s (2 n**3 FLOP each): fp32 and bf16 with torch (the
    engine's own kernels) when it is installed, else fp32 with numpy."""
    try:
        import torch
    except ImportError:
        torch = None
    out = {}
    if torch is not None:
        for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(dt)
            x @ x  # warm up the thread pool and the kernel choice
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                x @ x
                best = min(best, time.perf_counter() - t0)
            out[name] = 2 * n**3 / best
        return out
    import numpy as np
    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    x @ x
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t0)
    return {"fp32": 2 * n**3 / best}


def _local_from_dict(d: dict) -> Hardware:
    peaks = {k: float(d[k]) for k in ("fp32", "bf16") if k in d}
    return Hardware("local", peaks, float(d["mem_bandwidth"]),
                    float(d["mem_bytes"]), None,
                    f"measured {d['measured_at']}: {d['method']}", "physical RAM (bytes)")
