"""The kernels' weight formats and their packing: :class:`X16Weight` (4- or 8-bit group-32
weights in the x16 layout), :class:`X16Layer` (a decoder layer's x16 weights for the fused layer
call), :class:`AmxWeight` (bf16 weights in the AMX GEMM's tile layout), and the functions that
make them from a ``QuantizedWeight`` or a float tensor through the library ``lib``
(:class:`sloserve.kernels.Kernels`' ``pack_*`` and ``x16_layer`` methods call these).

A packed weight takes its tensors' data pointers once, and the x16 types their C structs
(``SlX16``, ``SlX16Layer`` in ``csrc/x16_layer.h``), which live exactly as long as the weight.
"""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch

from sloserve.kernels._lib import _ptr, _SlX16, _SlX16Layer


@dataclasses.dataclass(frozen=True)
class X16Weight:
    """A 4- or 8-bit group-32 weight in the kernels' x16 layout (rows interleaved in blocks of 16
    so one integer dot-product instruction covers 16 rows; per block and group of 32 inputs one
    record of the codes, then the 16 rows' scales, then their offsets: see
    ``csrc/qlinear_x16.h``).

    Attributes:
        packed: uint8 [N / 16 * K / 32 * record bytes]: the records, block after block (the
            codes are the same bytes as the QuantizedWeight's).
        shape: (N, K).
        bits: 4 or 8.
        has_mins: the records hold offsets (Q4_1-like).
        scale16: the scales and offsets are float16, where every one of them is exactly a
            float16 (GGUF's Q4_0 / Q4_1 / Q8_0), else float32.
        swiglu: the blocks alternate gate and up rows (``pack_x16_swiglu``): only
            ``qlinear_x16_swiglu``.
    """

    packed: torch.Tensor
    shape: tuple[int, int]
    bits: int = 4
    has_mins: bool = False
    scale16: bool = False
    swiglu: bool = False
    # the C side's SlX16 (its address is what the products take: a step makes ~120 of them;
    # each saved conversion costs ~1 us), which lives exactly as long as the weight
    c_struct: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "c_struct", _SlX16(
            _ptr(self.packed), self.bits, int(self.has_mins), int(self.scale16), *self.shape))

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    @property
    def format(self) -> str:
        """e.g. ``x16:4b+mins+f16``: what the crossover cache and the start-up line name."""
        return (f"x16:{self.bits}b{'+mins' if self.has_mins else ''}"
                f"{'+f16' if self.scale16 else ''}{':swiglu' if self.swiglu else ''}")


@dataclasses.dataclass(frozen=True)
class X16Layer:
    """A decoder layer's weights for :meth:`Kernels.run_x16_layer`, checked once by
    :func:`x16_layer` (a step then checks only its own tensors).

    Attributes:
        wo, gate_up, down: the output projection [d, Hq * D], the gate/up weight packed for
            the SwiGLU epilogue [2F, d], the down projection [d, F].
        ln2: the post-attention norm's weight [d] float32.
        nxt: the next layer's (input norm weight [d], q/k/v weight [(Hq + 2 Hk) D, d], q/k/v
            bias or None), or None for the last layer.
        heads: (Hq, Hk, D) of the next layer's q/k/v (None for the last layer).
        eps: the norms' epsilon.
    """

    wo: X16Weight
    ln2: torch.Tensor
    gate_up: X16Weight
    down: X16Weight
    eps: float
    nxt: tuple[torch.Tensor, X16Weight, torch.Tensor | None] | None = None
    heads: tuple[int, int, int] | None = None
    c_struct: Any = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        ln1, wqkv, bias = self.nxt or (None, None, None)
        hq, hk, hd = self.heads or (0, 0, 0)
        addr = lambda w: ctypes.addressof(w.c_struct) if w is not None else None  # noqa: E731
        ptr = lambda t: _ptr(t) if t is not None else None  # noqa: E731
        object.__setattr__(self, "c_struct", _SlX16Layer(
            addr(self.wo), addr(self.gate_up), addr(self.down), _ptr(self.ln2), ptr(ln1),
            addr(wqkv), ptr(bias), hq, hk, hd, self.eps))


@dataclasses.dataclass(frozen=True)
class AmxWeight:
    """A bfloat16 weight [N, K] packed for the AMX GEMM (``amx_linear``): per 32 output rows and
    32 inputs, two 16 x 16 tiles of input pairs (see ``csrc/amx_gemm.h``).

    Attributes:
        packed: bfloat16 [N * K] in that layout.
        shape: (N, K).
    """

    packed: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * 2


def pack_x16(lib: ctypes.CDLL, w) -> X16Weight | None:
    """``w`` (a 4- or 8-bit group-32 QuantizedWeight) repacked for ``Kernels.qlinear_x16``, its
    scales and offsets as float16 where each of them is exactly one; None when its shape does
    not allow it (rows not a multiple of 16, other groups)."""
    return _pack_x16(lib, w, False)


def pack_x16_swiglu(lib: ctypes.CDLL, gate_up) -> X16Weight | None:
    """A fused gate/up weight (QuantizedWeight [2F, K]: gate rows, then up rows) in the x16
    layout with its 16-row blocks reordered gate 0, up 0, gate 1, up 1, ... for
    ``Kernels.qlinear_x16_swiglu``; None where :func:`pack_x16` would refuse it or F % 16."""
    if gate_up.shape[0] % 32:
        return None
    return _pack_x16(lib, gate_up, True)


def _pack_x16(lib: ctypes.CDLL, w, swiglu: bool) -> X16Weight | None:
    N, K = w.shape
    if w.bits not in (4, 8) or w.group_size != 32 or N % 16 or K % 32:
        return None
    parts = [w.scales.contiguous()] + ([w.mins.contiguous()] if w.has_mins else [])
    halves = [t.half() for t in parts]
    h16 = all(torch.equal(h.float(), t) for h, t in zip(halves, parts))
    if h16:
        parts = halves
    ss = 2 if h16 else 4
    rec = 64 * w.bits + 16 * ss * len(parts)
    block = K // 32 * rec  # bytes of one 16-row block
    out = torch.empty(N // 16 * block, dtype=torch.uint8)
    qw, row_q, row_s = _ptr(w.qweight), K * w.bits // 8, K // 32 * ss
    sc, mn = _ptr(parts[0]), _ptr(parts[1]) if w.has_mins else None

    def repack(row: int, rows: int, at: int) -> int:  # rows [row, row + rows) -> out[at:]
        return lib.sl_repack_x16(qw + row * row_q, sc + row * row_s,
                                 mn + row * row_s if mn is not None else None, rows, K, w.bits,
                                 ss, _ptr(out) + at)
    if not swiglu:
        if repack(0, N, 0):
            return None
    else:  # gate block j -> block 2j, up block j -> 2j + 1, packed in place (no reordering copy)
        half = N // 2
        for j in range(half // 16):
            if repack(16 * j, 16, 2 * j * block) or repack(half + 16 * j, 16, (2 * j + 1) * block):
                return None
    return X16Weight(out, (N, K), w.bits, w.has_mins, h16, swiglu)


def x16_layer(wo: X16Weight, ln2: torch.Tensor, gate_up: X16Weight, down: X16Weight,
              eps: float,
              nxt: tuple[torch.Tensor, X16Weight, torch.Tensor | None] | None = None,
              heads: tuple[int, int, int] | None = None) -> X16Layer:
    """A layer's weights for ``Kernels.run_x16_layer``, checked: ``gate_up`` packed by
    :func:`pack_x16_swiglu`, the others plain x16; norm weights and bias contiguous float32
    vectors of their widths; with ``nxt`` (the next layer's input norm, q/k/v weight and
    bias or None), ``heads`` = (Hq, Hk, D) with Hq * D the output projection's input width
    and (Hq + 2 Hk) D the q/k/v weight's rows.

    Raises:
        ValueError: weights, vectors or head counts that do not fit.
    """
    d, F = wo.shape[0], gate_up.shape[0] // 2
    if not (not wo.swiglu and gate_up.swiglu and not down.swiglu and gate_up.shape[1] == d
            and down.shape == (d, F) and _vec(ln2, d)):
        raise ValueError(f"x16_layer_tail: weights that do not fit: wo {wo.shape}, gate_up "
                         f"{gate_up.shape} (swiglu {gate_up.swiglu}), down {down.shape}, "
                         f"ln2 {list(ln2.shape)} {ln2.dtype}")
    if nxt is not None:
        if heads is None:
            raise ValueError("x16_layer_tail: the next layer's q/k/v needs the rope tables "
                             "and head counts")
        ln1, wqkv, bias = nxt
        hq, hk, hd = heads
        if (min(hq, hk) < 1 or hd < 2 or hd % 2 or hq * hd != wo.shape[1] or wqkv.swiglu
                or wqkv.shape != ((hq + 2 * hk) * hd, d) or not _vec(ln1, d)
                or (bias is not None and not _vec(bias, wqkv.shape[0]))):
            raise ValueError(f"x16_layer_tail: qkv weight {wqkv.shape} / norm / bias do not "
                             f"fit {hq} + 2 x {hk} heads of {hd}")
    return X16Layer(wo, ln2, gate_up, down, eps, nxt, heads if nxt is not None else None)


def pack_amx(lib: ctypes.CDLL, w: torch.Tensor) -> AmxWeight | None:
    """``w`` [N, K] (any float dtype; rounded to bfloat16) packed for ``Kernels.amx_linear``;
    None when N % 16 or K % 32 is not 0 (the caller checks that the CPU has AMX)."""
    N, K = w.shape
    if N % 16 or K % 32:
        return None
    src = w.detach().to(torch.bfloat16).contiguous()
    out = torch.empty(N * K, dtype=torch.bfloat16)
    if lib.sl_amx_pack_bf16(_ptr(src), N, K, _ptr(out)):
        return None
    return AmxWeight(out, (N, K))


def pack_amx_swiglu(lib: ctypes.CDLL, gate_up: torch.Tensor) -> AmxWeight | None:
    """The fused gate/up weight ``gate_up`` [2F, K] (gate rows, then up rows) packed for
    ``Kernels.amx_swiglu``: rows interleaved by 16 (gate 0-15, up 0-15, gate 16-31, ...) so
    that each 32-column block of the product is one block of 16 features' gate and up.
    None where :func:`pack_amx` gives None or F % 16 != 0."""
    N, K = gate_up.shape
    if N % 32:
        return None
    F = N // 2
    il = gate_up.detach().reshape(2, F // 16, 16, K).transpose(0, 1).reshape(N, K)
    return pack_amx(lib, il)


def _vec(t: torch.Tensor, n: int) -> bool:
    """t is a contiguous float32 vector of n values."""
    return t.shape == (n,) and t.dtype == torch.float32 and t.is_contiguous()


