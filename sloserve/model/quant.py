"""Weight-only quantized weights as the engine keeps them in memory.

A :class:`QuantizedWeight` is an [N, K] matrix of integer codes with one scale ``d`` and one offset
``m`` per group of ``group_size`` consecutive inputs: ``W[n, k] = d[n, g] * q[n, k] + m[n, g]``,
``g = k // group_size``. Two code widths:

* 4 bits, groups of 32: codes 0..15 packed two per byte, 16 bytes per group, byte j holding
  code j (low nibble) and code j + 16 (high nibble), GGUF's Q4_0/Q4_1 order;
* 8 bits (int8), groups of 32 or 16.

GGUF tensors map onto these exactly (:func:`from_gguf`: the same numbers as ``gguf``'s own
dequantization): Q4_0 (m = -8 d), Q4_1 and Q4_K (4-bit, 32), Q8_0, Q5_0, Q5_1, Q5_K (int8, 32),
Q6_K, Q3_K and Q2_K (int8, 16; their 16-weight sub-blocks each have their own scale). Other
encodings (IQ*, TQ*, F16 weights) are requantized from their float values by
:func:`quantize_int8` or :func:`quantize_int4` (``--quantization int8`` / ``int4`` do that for every
linear weight), which round: their error is stated at load.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256


@dataclass
class QuantizedWeight:
    """See the module docstring.

    Attributes:
        qweight: 4-bit: uint8 [N, K / 2]; 8-bit: int8 [N, K] (viewed as uint8 by the kernels).
        scales: float32 [N, K / group_size].
        mins: float32 [N, K / group_size], or None when every offset is 0.
        bits: 4 or 8.
        group_size: 32 (4-bit) or 32 / 16 (8-bit).
        shape: (N, K).
        source: the encoding it came from ("Q4_1", "Q8_0", "int8 from F16", ...).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    shape: tuple[int, int]
    source: str

    @property
    def has_mins(self) -> bool:
        return self.mins is not None

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + scales + offsets."""
        n = self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 4
        return n + (self.mins.numel() * 4 if self.mins is not None else 0)

    def codes(self) -> torch.Tensor:
        """The integer codes q as float32 [N, K]."""
        n, k = self.shape
        if self.bits == 8:
            return self.qweight.view(torch.int8).float()
        b = self.qweight.view(n, k // 32, 16)
        lo, hi = (b & 15).float(), (b >> 4).float()
        return torch.cat([lo, hi], dim=-1).reshape(n, k)

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K] (exactly d * q + m, rounded once to float32)."""
        n, k = self.shape
        g = self.group_size
        q = self.codes().view(n, k // g, g)
        w = q * self.scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.reshape(n, k)

    def select_rows(self, rows: torch.Tensor) -> "QuantizedWeight":
        """The rows ``rows`` (int64) in that order (e.g. un-permuting Q/K rows)."""
        return QuantizedWeight(self.qweight[rows].contiguous(), self.scales[rows].contiguous(),
                               None if self.mins is None else self.mins[rows].contiguous(),
                               self.bits, self.group_size, (len(rows), self.shape[1]), self.source)


def concat_rows(ws: list[QuantizedWeight]) -> QuantizedWeight | None:
    """One weight holding ``ws`` one after another along N (a fused QKV or gate/up projection),
    or None when their formats differ."""
    first = ws[0]
    if any((w.bits, w.group_size, w.shape[1]) != (first.bits, first.group_size, first.shape[1])
           for w in ws):
        return None
    mins = None
    if any(w.mins is not None for w in ws):
        mins = torch.cat([w.mins if w.mins is not None else torch.zeros_like(w.scales) for w in ws])
    return QuantizedWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]),
                           mins, first.bits, first.group_size,
                           (sum(w.shape[0] for w in ws), first.shape[1]),
                           "+".join(dict.fromkeys(w.source for w in ws)))


# ----------------------------------------------------------------------------- packing
def _pack4(q: np.ndarray) -> np.ndarray:
    """codes uint8 [..., K] (0..15) -> [..., K / 2] in the 16-bytes-per-32 layout."""
    g = q.reshape(*q.shape[:-1], -1, 2, 16)
    return (g[..., 0, :] | (g[..., 1, :] << 4)).reshape(*q.shape[:-1], -1).astype(np.uint8)


def _make(codes: np.ndarray, d: np.ndarray, m: np.ndarray | None, bits: int, gs: int,
          shape: tuple[int, int], source: str, packed: bool = False) -> QuantizedWeight:
    """``packed``: ``codes`` are already 4-bit codes in :func:`_pack4`'s layout ([N, K / 2])."""
    n, k = shape
    if packed:
        qw = torch.from_numpy(np.ascontiguousarray(codes).reshape(n, k // 2))
    elif bits == 4:
        qw = torch.from_numpy(_pack4(codes.reshape(n, k).astype(np.uint8)))
    else:
        qw = torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k).astype(np.int8)))
    d = torch.from_numpy(np.ascontiguousarray(d.reshape(n, k // gs), dtype=np.float32))
    mt = None
    if m is not None and np.any(m != 0):
        mt = torch.from_numpy(np.ascontiguousarray(m.reshape(n, k // gs), dtype=np.float32))
    return QuantizedWeight(qw, d, mt, bits, gs, (n, k), source)


def _f16(b: np.ndarray) -> np.ndarray:
    """Float16 bytes (uint8 [..., 2k], the last axis contiguous, e.g. a column slice of a
    block table, read in place) as float32 [..., k]."""
    return b.view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> ([nb, 8], [nb, 8])."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, any shape, row-major over [N, K]) as a
    QuantizedWeight with exactly the values ``gguf.quants.dequantize`` gives.

    Raises:
        ValueError: an encoding with no exact mapping (the caller requantizes those), or data
            whose size does not fit ``shape``.
    """
    n, k = shape
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    t = type_name
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[t]
        nb = n * k // 32
        if b.size != nb * size:
            raise ValueError(f"{t} data of {b.size} bytes does not fit {shape}")
        blk = b.reshape(nb, size)
        d = _f16(blk[:, 0:2])[:, 0]
        if t == "Q8_0":
            return _make(blk[:, 2:].view(np.int8), d, None, 8, 32, shape, t)
        off = 4 if t in ("Q4_1", "Q5_1") else 2
        m = _f16(blk[:, 2:4])[:, 0] if off == 4 else None
        if t in ("Q5_0", "Q5_1"):
            qh = blk[:, off:off + 4].copy().view(np.uint32)[:, 0]
            qs = blk[:, off + 4:]
            bits_hi = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        else:
            qs = blk[:, off:]
            # a block's 16 bytes hold code j in the low and code j + 16 in the high nibble of
            # byte j: already _pack4's layout, taken as stored
            return _make(qs, d, -8.0 * d if t == "Q4_0" else m, 4, 32, shape, t, packed=True)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int16)   # [nb, 32]
        q = q | (bits_hi.astype(np.int16) << 4)                              # 0..31
        if t == "Q5_0":
            return _make(q - 16, d, None, 8, 32, shape, t)
        return _make(q, d, m, 8, 32, shape, t)
    if t in ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"):
        size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84}[t]
        nb = n * k // QK_K
        if b.size != nb * size:
            raise ValueError(f"{t} data of {b.size} bytes does not fit {shape}")
        blk = b.reshape(nb, size)
        if t in ("Q4_K", "Q5_K"):
            d = _f16(blk[:, 0:2])
            dmin = _f16(blk[:, 2:4])
            sc, mn = _k_scale_min(blk[:, 4:16])
            dg, mg = d * sc, -(dmin * mn)                                        # [nb, 8]
            if t == "Q4_K":
                qs = blk[:, 16:].reshape(nb, 4, 32)
                q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, QK_K)
                return _make(q, dg, mg, 4, 32, shape, t)
            qh = blk[:, 16:48].reshape(nb, 1, 32)
            qs = blk[:, 48:].reshape(nb, 4, 32)
            ql = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 8, 32)
            hb = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            q = (ql | (hb << 4)).reshape(nb, QK_K).astype(np.int16)
            return _make(q, dg, mg, 8, 32, shape, t)
        if t == "Q6_K":
            ql = blk[:, 0:128].reshape(nb, 2, 1, 64)
            qh = blk[:, 128:192].reshape(nb, 2, 1, 32)
            sc = blk[:, 192:208].copy().view(np.int8).astype(np.float32)
            d = _f16(blk[:, 208:210])
            lo = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F)
            lo = lo.reshape(nb, 8, 32)
            hi = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
            hi = hi.reshape(nb, 8, 32)
            q = (lo | (hi << 4)).astype(np.int16) - 32
            return _make(q.reshape(nb, QK_K), d * sc, None, 8, 16, shape, t)
        if t == "Q2_K":
            scales = blk[:, 0:16]
            qs = blk[:, 16:80].reshape(nb, 2, 1, 32)
            d = _f16(blk[:, 80:82])
            dmin = _f16(blk[:, 82:84])
            q = (qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
            q = q.reshape(nb, QK_K).astype(np.int16)
            dg = d * (scales & 0x0F).astype(np.float32)
            mg = -(dmin * (scales >> 4).astype(np.float32))
            return _make(q, dg, mg, 8, 16, shape, t)
        # Q3_K
        hmask = blk[:, 0:32].reshape(nb, 1, 32)
        qs = blk[:, 32:96].reshape(nb, 2, 1, 32)
        scb = blk[:, 96:108]
        d = _f16(blk[:, 108:110])
        lsc = (scb[:, 0:8].reshape(nb, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1))
        lsc = lsc.reshape(nb, 16)
        hsc = (scb[:, 8:12].reshape(nb, 1, 4)
               >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(nb, 16)
        sc = ((lsc & 0x0F) | ((hsc & 3) << 4)).astype(np.int16) - 32
        ql = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3)
        ql = ql.reshape(nb, QK_K)
        qh = ((hmask >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(nb, QK_K)
        q = ql.astype(np.int16) - ((qh ^ 1).astype(np.int16) << 2)
        return _make(q, d * sc.astype(np.float32), None, 8, 16, shape, t)
    raise ValueError(f"no exact mapping for GGUF type {t}")


# ----------------------------------------------------------------------------- requantizing
def quantize_int8(w: torch.Tensor, source: str) -> QuantizedWeight:
    """Symmetric int8 per group of 32 (Q8_0's rule: d = max |w| / 127, q = round(w / d))."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int8 quantization needs K divisible by 32, got {k}")
    g = w.float().reshape(n, k // 32, 32)
    d = g.abs().amax(-1) / 127.0
    q = torch.where(d[..., None] > 0, torch.round(g / d.clamp_min(1e-30)[..., None]),
                    torch.zeros_like(g)).clamp(-127, 127)
    return QuantizedWeight(q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous(), None, 8,
                           32, (n, k), f"int8 from {source}")


def quantize_int4(w: torch.Tensor, source: str) -> QuantizedWeight:
    """Asymmetric 4-bit per group of 32 (Q4_1's rule: d = (max - min) / 15, m = min)."""
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int4 quantization needs K divisible by 32, got {k}")
    g = w.float().reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15.0
    q = torch.where(d[..., None] > 0, torch.round((g - lo[..., None]) / d.clamp_min(1e-30)[..., None]),
                    torch.zeros_like(g)).clamp(0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedWeight(torch.from_numpy(_pack4(q.numpy())), d.contiguous(), lo.contiguous(),
                           4, 32, (n, k), f"int4 from {source}")
