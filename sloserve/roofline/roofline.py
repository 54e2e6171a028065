"""The roofline model (Williams, Waterman & Patterson, CACM 2009).

For a kernel doing ``flops`` FLOP while moving ``bytes`` bytes to/from memory:

- arithmetic intensity ``I = flops / bytes`` (FLOP/byte);
- machine balance (ridge point) ``I* = peak / bandwidth`` (FLOP/byte);
- attainable rate ``min(peak, I x bandwidth)`` (FLOP/s): memory-bound when ``I < I*``,
  compute-bound otherwise;
- lower-bound time ``max(flops / peak, bytes / bandwidth)`` (s);
- MFU at the bound = attainable / peak (model FLOPs utilisation, Chowdhery et al., PaLM 2022).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from sloserve.roofline.hardware import Hardware


def attainable_flops(intensity: float, peak: float, bandwidth: float) -> float:
    """``min(peak, intensity x bandwidth)``, FLOP/s."""
    return min(peak, intensity * bandwidth)


@dataclass(frozen=True)
class RooflinePoint:
    """One kernel (or a whole step) on one machine.

    Attributes: flops (FLOP), bytes (B), intensity (FLOP/B), balance (FLOP/B), peak (FLOP/s),
    bandwidth (B/s), attainable (FLOP/s), mfu (fraction 0..1), time (s, lower bound),
    bound ("compute" or "memory").
    """

    flops: float
    bytes: float
    intensity: float
    balance: float
    peak: float
    bandwidth: float
    attainable: float
    mfu: float
    time: float
    bound: str

    def to_dict(self) -> dict:
        return asdict(self)


def roofline_point(flops: float, nbytes: float, hw: Hardware, dtype: str = "bf16") -> RooflinePoint:
    """Place ``flops`` / ``nbytes`` on ``hw``'s roofline at ``dtype``'s peak."""
    peak, bw = hw.peak(dtype), hw.mem_bandwidth
    intensity = flops / nbytes if nbytes else float("inf")
    att = attainable_flops(intensity, peak, bw)
    t = max(flops / peak, nbytes / bw)
    return RooflinePoint(flops, nbytes, intensity, peak / bw, peak, bw, att, att / peak, t,
                         "compute" if intensity >= peak / bw else "memory")
