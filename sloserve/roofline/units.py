"""Units and formatting.

Decimal (SI) units are what vendors use for bandwidth and FLOP/s and for most memory sizes
(1 GB = 10**9 bytes, 1 TB/s = 10**12 bytes/s, 1 TFLOP/s = 10**12 FLOP/s). Binary (IEC) units are
what allocators and ``nvidia-smi`` use (1 GiB = 2**30 bytes = 1.073741824 GB). Every byte count this
package prints shows both when they differ, e.g. ``10.00 GiB (10.74 GB)``.
"""
from __future__ import annotations

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
TFLOPS = 10**12  # FLOP/s
GBPS_NET = 10**9 / 8  # bytes/s in one Gbit/s (network links are quoted in decimal bits)


def fmt_bytes(n: float) -> str:
    """Bytes as ``'<x> GiB (<y> GB)'`` (or MiB/MB, KiB/kB, B), both shown when they differ."""
    n = float(n)
    for bin_u, bin_name, dec_u, dec_name in ((TiB, "TiB", TB, "TB"), (GiB, "GiB", GB, "GB"),
                                             (MiB, "MiB", MB, "MB"), (KiB, "KiB", KB, "kB")):
        if abs(n) >= bin_u:
            a, b = f"{n / bin_u:.2f} {bin_name}", f"{n / dec_u:.2f} {dec_name}"
            return a if n % bin_u == 0 and n % dec_u == 0 else f"{a} ({b})"
    return f"{n:,.0f} B"


def fmt_flops(f: float) -> str:
    """FLOP (count), scaled: ``'1.23 TFLOP'``."""
    return _scaled(f, "FLOP")


def fmt_flops_rate(f: float) -> str:
    """FLOP/s, scaled: ``'989.00 TFLOP/s'``."""
    return _scaled(f, "FLOP/s")


def fmt_bandwidth(b: float) -> str:
    """Bytes/s in decimal units: ``'3.35 TB/s'``."""
    return _scaled(b, "B/s")


def fmt_time(s: float) -> str:
    """Seconds as s / ms / us."""
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.3f} us"


def _scaled(v: float, unit: str) -> str:
    for f, p in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= f:
            return f"{v / f:.2f} {p}{unit}"
    return f"{v:.2f} {unit}"
