"""The kernels' ops: :class:`Kernels`, one loaded library (``sloserve.kernels.load()``) with a
method per C API function.

Every op takes contiguous float32 tensors (and int64 index tensors) and calls the library with
their data pointers; shapes are checked here, once per call. Packing weights for the products
is ``sloserve.kernels.packing``'s (the ``pack_*`` methods call it).
"""
from __future__ import annotations

import ctypes
import os
import threading

import torch

from sloserve.kernels import packing
from sloserve.kernels._lib import AMX_ENV, _ptr, open_library
from sloserve.kernels.packing import AmxWeight, X16Layer, X16Weight


class Kernels:
    """The loaded library of one variant (``variant``: avx512, avx2 or generic)."""

    def __init__(self, path: str, variant: str):
        self.path, self.variant = path, variant
        self.lib = open_library(path)
        self.isa = self.lib.sl_isa()
        self._tls = threading.local()
        #: the AMX bf16 GEMM is usable: AVX-512 library, a CPU with AMX-BF16, the OS granting
        #: the tile state, and ``$SLOSERVE_AMX`` not ``0``
        self.amx = os.environ.get(AMX_ENV, "1") != "0" and bool(self.lib.sl_amx_init())
        self._avx512_bf16 = bool(self.lib.sl_avx512_bf16())

    @property
    def prefill_attn_isa(self) -> str | None:
        """Where the in-place bf16 prefill attention (:meth:`prefill_attn`) runs here: ``amx``
        (the tiles, while :attr:`amx` is on), else ``avx512_bf16`` (its dot products), else None
        (neither usable: callers take torch's flash attention)."""
        return "amx" if self.amx else "avx512_bf16" if self._avx512_bf16 else None

    def set_num_threads(self, n: int) -> None:
        self.lib.sl_set_num_threads(n)

    # ------------------------------------------------------------------ linear
    def qlinear(self, x: torch.Tensor, w) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T for a QuantizedWeight ``w`` -> [M, N] float32."""
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        xsum = torch.empty(M * (K // w.group_size), dtype=torch.float32) if w.has_mins else None
        rc = self.lib.sl_qlinear(_ptr(x), M, K, _ptr(w.qweight), _ptr(w.scales),
                                 _ptr(w.mins) if w.has_mins else None, w.bits, w.group_size, N,
                                 _ptr(y), _ptr(xsum) if xsum is not None else None)
        if rc:
            raise ValueError(f"no kernel for {w.bits}-bit weights in groups of {w.group_size}")
        return y

    def qlinear_i8(self, x: torch.Tensor, w) -> torch.Tensor:
        """As :meth:`qlinear` with x quantized to int8 per group of 32 first (integer dot
        products: VNNI / pmaddubsw); 4-bit or int8 weights in groups of 32."""
        M, K = x.shape
        N = w.shape[0]
        y = torch.empty(M, N, dtype=torch.float32)
        scratch = torch.empty(M * K + 64 + 8 * M * (K // 32), dtype=torch.uint8)
        rc = self.lib.sl_qlinear_i8(_ptr(x), M, K, _ptr(w.qweight), _ptr(w.scales),
                                    _ptr(w.mins) if w.has_mins else None, w.bits, w.group_size,
                                    N, _ptr(y), _ptr(scratch))
        if rc:
            raise ValueError(f"no int8-activation kernel for {w.bits}-bit weights in groups of "
                             f"{w.group_size}")
        return y

    def pack_x16(self, w) -> X16Weight | None:
        """``w`` (a 4- or 8-bit group-32 QuantizedWeight) repacked for :meth:`qlinear_x16`; None
        when its shape does not allow it (:func:`sloserve.kernels.packing.pack_x16`)."""
        return packing.pack_x16(self.lib, w)

    def pack_x16_swiglu(self, gate_up) -> X16Weight | None:
        """A fused gate/up weight (QuantizedWeight [2F, K]) in the x16 layout for
        :meth:`qlinear_x16_swiglu`; None where it does not fit
        (:func:`sloserve.kernels.packing.pack_x16_swiglu`)."""
        return packing.pack_x16_swiglu(self.lib, gate_up)

    def _scratch(self, nbytes: int) -> int:
        """A per-thread scratch buffer of at least ``nbytes`` (reused: no allocation per call)."""
        buf = getattr(self._tls, "buf", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._tls.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
        return buf.data_ptr()

    def qlinear_x16(self, x: torch.Tensor, w: X16Weight) -> torch.Tensor:
        """x [M, K] float32 contiguous @ W^T, x quantized to int8 per group of 32 (as
        :meth:`qlinear_i8`) -> [M, N] float32."""
        if w.swiglu:
            raise ValueError("qlinear_x16: a gate/up weight packed for qlinear_x16_swiglu")
        M, K = _check_x("qlinear_x16", x, w.shape[1])
        y = torch.empty(M, w.shape[0], dtype=torch.float32)
        self.lib.sl_qlinear_x16(x.data_ptr(), M, ctypes.addressof(w.c_struct), y.data_ptr(),
                                self._x16_scratch(M, K))
        return y

    def _x16_scratch(self, M: int, K: int) -> int:
        """The x16 products' scratch: int8 codes, scales, sums and integer sums of x [M, K]."""
        return self._scratch(M * K + 64 + 12 * M * (K // 32))

    def qlinear_x16_swiglu(self, x: torch.Tensor, w: X16Weight) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) for a :meth:`pack_x16_swiglu` weight, the activation in
        the product's epilogue: x [M, K] float32 contiguous -> [M, F] float32; the same numbers
        as :meth:`qlinear_x16` then :meth:`silu_mul`."""
        if not w.swiglu:
            raise ValueError("qlinear_x16_swiglu: a weight not packed by pack_x16_swiglu")
        M, K = _check_x("qlinear_x16_swiglu", x, w.shape[1])
        y = torch.empty(M, w.shape[0] // 2, dtype=torch.float32)
        self.lib.sl_qlinear_x16_swiglu(x.data_ptr(), M, ctypes.addressof(w.c_struct),
                                       y.data_ptr(), self._x16_scratch(M, K))
        return y

    #: a layer's weights for :meth:`run_x16_layer`, checked once
    #: (:func:`sloserve.kernels.packing.x16_layer`)
    x16_layer = staticmethod(packing.x16_layer)

    def run_x16_layer(self, layer: X16Layer, o: torch.Tensor, h: torch.Tensor,
                      bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """One decoder layer after its attention, and the next one up to its attention, in one
        call: ``delta = o Wo^T``, ``h += delta`` (in place), ``a = rmsnorm(h) * ln2``,
        ``f = silu(a Wg^T) * (a Wu^T)``, ``delta = f Wd^T``; then, where ``layer`` has the next
        layer's weights: ``h += delta``, ``a = rmsnorm(h) * ln1``, ``qkv = a Wqkv^T (+ bias)``
        with RoPE (``cos`` / ``sin`` [T, D / 2], :meth:`rope_tables`) on its query and key
        heads. The same numbers as :meth:`qlinear_x16`, :meth:`add_rms_norm`,
        :meth:`qlinear_x16_swiglu` and :meth:`rope` one after another, without a Python call,
        allocation or thread start between them.

        Args:
            layer: :meth:`x16_layer`'s result (its weights checked there, once).
            o: the attention output [T, Hq * D] float32 contiguous.
            h: the residual stream [T, d] float32 contiguous, updated in place.
            bufs: (delta [T, d], a [T, d], f [T, F]) float32 contiguous work buffers, reusable
                from layer to layer.

        Returns:
            the next layer's qkv [T, (Hq + 2 Hk) D] float32 with RoPE applied, or for the last
            layer the down projection's output ``delta`` (``bufs[0]``; not yet added to h).

        Raises:
            ValueError: a shape, dtype or layout of these tensors that does not fit.
        """
        wo = layer.wo
        T, _ = _check_x("x16_layer_tail", o, wo.shape[1])
        d, F = wo.shape[0], layer.gate_up.shape[0] // 2
        if not (h.shape == (T, d) and h.dtype == torch.float32 and h.is_contiguous()
                and len(bufs) == 3 and all(b.dim() == 2 and b.shape[0] >= T and b.shape[1] == n
                                           and b.dtype == torch.float32 and b.is_contiguous()
                                           for b, n in zip(bufs, (d, d, F)))):
            raise ValueError(f"x16_layer_tail: buffers that do not fit: o {list(o.shape)}, h "
                             f"{list(h.shape)}, bufs {[list(b.shape) for b in bufs]}")
        qkv = None
        if layer.nxt is not None:
            hd = layer.heads[2]
            if cos is None or sin is None or not all(
                    t.shape == (T, hd // 2) and t.dtype == torch.float32 and t.is_contiguous()
                    for t in (cos, sin)):
                raise ValueError(f"x16_layer_tail: rope tables that do not fit [{T}, {hd // 2}] "
                                 f"float32")
            qkv = torch.empty(T, layer.nxt[1].shape[0], dtype=torch.float32)
        delta, a, f = bufs
        self.lib.sl_x16_layer_tail(
            ctypes.addressof(layer.c_struct), _ptr(o), T, _ptr(h), _ptr(delta), _ptr(a),
            _ptr(f), _ptr(qkv) if qkv is not None else None,
            _ptr(cos) if qkv is not None else None, _ptr(sin) if qkv is not None else None,
            self._x16_scratch(T, max(F, wo.shape[1], d)))
        return qkv if qkv is not None else delta[:T]

    def x16_layer_tail(self, o: torch.Tensor, h: torch.Tensor, wo: X16Weight, ln2: torch.Tensor,
                       gate_up: X16Weight, down: X16Weight, eps: float,
                       bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                       nxt: tuple[torch.Tensor, X16Weight, torch.Tensor | None] | None = None,
                       rope: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
                       ) -> torch.Tensor:
        """:meth:`run_x16_layer` of ``x16_layer(wo, ln2, gate_up, down, eps, nxt, heads)``,
        ``rope`` = (cos, sin, Hq, Hk, D): the weights checked on every call (a step's loop
        makes its X16Layer once instead)."""
        layer = self.x16_layer(wo, ln2, gate_up, down, eps, nxt,
                               tuple(rope[2:]) if rope is not None else None)
        cos, sin = rope[:2] if rope is not None else (None, None)
        return self.run_x16_layer(layer, o, h, bufs, cos, sin)

    def pack_amx(self, w: torch.Tensor) -> AmxWeight | None:
        """``w`` [N, K] (any float dtype; rounded to bfloat16) packed for :meth:`amx_linear`;
        None without AMX here or when N % 16 or K % 32 is not 0."""
        return packing.pack_amx(self.lib, w) if self.amx else None

    def amx_linear(self, x: torch.Tensor, w: AmxWeight) -> torch.Tensor:
        """x [M, K] float32 contiguous (rounded to bfloat16) @ W^T on the AMX tiles, float32
        accumulation -> [M, N] float32. Raises ValueError on shapes, RuntimeError without AMX."""
        return self._amx_call("amx_linear", self.lib.sl_amx_linear, x, w, w.shape[0], 2048)

    def pack_amx_swiglu(self, gate_up: torch.Tensor) -> AmxWeight | None:
        """The fused gate/up weight ``gate_up`` [2F, K] (gate rows, then up rows) packed for
        :meth:`amx_swiglu`; None without AMX here or where the shape does not fit
        (:func:`sloserve.kernels.packing.pack_amx_swiglu`)."""
        return packing.pack_amx_swiglu(self.lib, gate_up) if self.amx else None

    def amx_swiglu(self, x: torch.Tensor, w: AmxWeight) -> torch.Tensor:
        """SwiGLU in the gate/up product's epilogue: x [M, K] float32 contiguous (rounded to
        bfloat16), ``w`` from :meth:`pack_amx_swiglu` of [2F, K] -> silu(x W_gate^T) * (x
        W_up^T) [M, F] float32 (products accumulated in float32 on the AMX tiles; SiLU as
        :meth:`silu_mul`'s). Raises ValueError on shapes, RuntimeError without AMX."""
        return self._amx_call("amx_swiglu", self.lib.sl_amx_swiglu, x, w, w.shape[0] // 2, 4096)

    def _amx_call(self, name: str, fn, x: torch.Tensor, w: AmxWeight, out_cols: int,
                  thread_bytes: int) -> torch.Tensor:
        """``fn(x, M, K, packed W, N, y, scratch)`` -> y [M, out_cols] float32; the scratch holds
        x in bf16 (rows rounded up to 16) and ``thread_bytes`` per thread."""
        M, K = _check_x(name, x, w.shape[1])
        y = torch.empty(M, out_cols, dtype=torch.float32)
        scratch = self._scratch(-(-M // 16) * 16 * K * 2
                                + thread_bytes * max(1, self.lib.sl_num_threads()))
        if fn(x.data_ptr(), M, K, w.packed.data_ptr(), w.shape[0], y.data_ptr(), scratch):
            raise RuntimeError(f"{name}: the {self.variant} kernels have no AMX GEMM")
        return y

    def qembed(self, ids: torch.Tensor, w) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of a QuantizedWeight, dequantized -> [T, K] float32."""
        T = ids.shape[0]
        out = torch.empty(T, w.shape[1], dtype=torch.float32)
        self.lib.sl_qembed(_ptr(ids), T, _ptr(w.qweight), _ptr(w.scales),
                           _ptr(w.mins) if w.has_mins else None, w.bits, w.group_size,
                           w.shape[1], _ptr(out))
        return out

    # ------------------------------------------------------------------ elementwise
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """rmsnorm(x) * w: x [T, D] float32 -> [T, D] in ``out_dtype`` (float32 or bfloat16)."""
        out = torch.empty(x.shape, dtype=out_dtype)
        self.lib.sl_rms_norm(_ptr(x), _ptr(w), x.shape[0], x.shape[1], eps, _ptr(out),
                             _is_bf16(out_dtype))
        return out

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                     eps: float, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``h += delta`` in place (h [T, D] float32; delta float32 or bfloat16), returns
        rmsnorm(h) * w in ``out_dtype`` (float32 or bfloat16)."""
        out = torch.empty(h.shape, dtype=out_dtype)
        self.lib.sl_add_rms_norm(_ptr(h), _ptr(delta), _ptr(w), h.shape[0], h.shape[1], eps,
                                 _ptr(out), _is_bf16(delta.dtype), _is_bf16(out_dtype))
        return out

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: gu [T, 2F] (gate then up) float32 or bfloat16 -> [T, F], same dtype."""
        T, F2 = gu.shape
        out = torch.empty(T, F2 // 2, dtype=gu.dtype)
        self.lib.sl_silu_mul(_ptr(gu), T, F2 // 2, _ptr(out), _is_bf16(gu.dtype))
        return out

    @staticmethod
    def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
        """cos and sin [T, D / 2] float32 of the angles positions[t] * inv_freq[i] (float32, as
        transformers computes them): once per step, for every layer's :meth:`rope`."""
        ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
        return ang.cos().contiguous(), ang.sin().contiguous()

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> None:
        """In place on q [T, Hq, D] and k [T, Hk, D] (float32 views; heads contiguous), with
        :meth:`rope_tables`' cos / sin [T, D / 2]."""
        T, hq, d = q.shape
        if cos.shape != (T, d // 2) or sin.shape != cos.shape or cos.dtype != torch.float32 \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rope: cos / sin must be contiguous float32 [{T}, {d // 2}], got "
                             f"{tuple(cos.shape)} {cos.dtype} / {tuple(sin.shape)}")
        self.lib.sl_rope(_ptr(q), q.stride(0), _ptr(k), k.stride(0), _ptr(cos), _ptr(sin),
                         T, hq, k.shape[1], d)

    # ------------------------------------------------------------------ attention
    def cache_write(self, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """k, v [T, Hkv, D] float32 views -> one layer's cache [2, blocks, bs, Hkv, entry] at
        slots (float32 or bf16 entries of D values; int8: quantized, see ``kv_int8``)."""
        T, hk, d = k.shape
        nslots = cache.shape[1] * cache.shape[2]
        self.lib.sl_cache_write(_ptr(k), k.stride(0), _ptr(v), v.stride(0), _ptr(cache),
                                _kv_kind(cache.dtype), _ptr(slots), T, nslots, hk, d)

    def paged_attn_decode(self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                          split_len: int) -> torch.Tensor:
        """One query token per request: q [B, H, D] float32 (heads contiguous) over one
        layer's cache (float32, bf16 or int8 entries) at block_table [B, N] / seq_lens [B]
        (int64) -> [B, H, D] float32."""
        B, H, D = q.shape
        hkv = cache.shape[3]
        splits = max(1, -(-max_seq_len // split_len))
        out = torch.empty(B, H, D, dtype=torch.float32)
        work = self._scratch(4 * B * hkv * splits * (H // hkv) * (D + 2))
        self.lib.sl_paged_attn_decode(
            _ptr(q), q.stride(0), _ptr(cache), _kv_kind(cache.dtype),
            _ptr(block_table), block_table.shape[1], _ptr(seq_lens), B, H, hkv, D,
            cache.shape[2], cache.shape[1], scale, split_len, splits, _ptr(out), work)
        return out


    def prefill_attn(self, q: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor,
                     num_computed: int, scale: float, isa: str | None = None,
                     invariant: bool = False) -> torch.Tensor:
        """Causal attention of one request's ``n`` new query tokens q [n, H, D] (float32, heads
        contiguous) over its whole context in one layer's bf16 cache [2, blocks, bs, Hkv, D]
        (positions 0 .. num_computed + n - 1, the chunk's K/V already written), through its
        block table ``blocks`` (int64, at least ceil(context / bs) entries) -> [n, H, D] float32.
        Flash attention over 64-token blocks with Q, K, V and the probabilities in bf16 and
        float32 accumulation (``csrc/prefill_attn.h``), on ``isa`` (``amx`` or ``avx512_bf16``;
        default :attr:`prefill_attn_isa`). ``invariant`` (``--batch-invariant``): each query
        token's output depends on its own scores alone, not on the chunk's other tokens, so it
        is the same whatever chunk it comes in (``csrc/prefill_attn.h``, INV). ValueError for
        D % 32 != 0, a non-bf16 cache, too few blocks or an ``isa`` this CPU cannot run."""
        isa = isa or self.prefill_attn_isa
        if not {"amx": self.amx, "avx512_bf16": self._avx512_bf16}.get(isa):
            raise ValueError(f"prefill_attn: isa {isa!r} is not available here "
                             f"(this CPU: {self.prefill_attn_isa})")
        n, H, D = q.shape
        _, nb, bs, hkv, dd = cache.shape
        if not isinstance(num_computed, int):
            raise ValueError(f"prefill_attn: num_computed must be an int, got {num_computed!r}")
        ctx = num_computed + n
        if cache.dtype != torch.bfloat16 or D % 32 or dd != D or hkv < 1 or H % hkv:
            raise ValueError(f"prefill_attn: needs a bf16 cache and head_dim % 32 == 0 "
                             f"(cache {cache.dtype}, D {D}, H {H}, Hkv {hkv})")
        if not cache.is_contiguous():  # the kernel walks [2, blocks, bs, Hkv, D] by its sizes
            raise ValueError(f"prefill_attn: the cache must be contiguous (strides "
                             f"{cache.stride()} for shape {tuple(cache.shape)})")
        if blocks.numel() * bs < ctx or q.stride(2) != 1 or q.stride(1) != D or num_computed < 0:
            raise ValueError(f"prefill_attn: {blocks.numel()} blocks of {bs} for a context "
                             f"of {ctx} ({num_computed} cached), or q not heads-contiguous")
        if q.dtype != torch.float32 or blocks.dtype != torch.int64 or not blocks.is_contiguous():
            raise ValueError(f"prefill_attn: q must be float32 ({q.dtype}) and the block "
                             f"table contiguous int64 ({blocks.dtype})")
        used = blocks[:-(-ctx // bs)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
            raise ValueError(f"prefill_attn: block ids {int(used.min())}..{int(used.max())} "
                             f"outside the cache's 0..{nb - 1}")
        out = torch.empty(n, H, D, dtype=torch.float32)
        threads = self.lib.sl_num_threads()
        scratch = self._scratch(self.lib.sl_prefill_attn_scratch(ctx, hkv, D, threads))
        if self.lib.sl_prefill_attn(q.data_ptr(), q.stride(0), n, num_computed,
                                    cache.data_ptr(), blocks.data_ptr(), bs, nb, H, hkv, D,
                                    scale, out.data_ptr(), scratch, int(isa == "amx"),
                                    int(invariant)):
            raise RuntimeError(f"the {self.variant} kernels have no bf16 prefill attention")
        return out


#: KV cache dtype -> the kernels' ``kv_kind`` (an int8 cache holds codes + a scale per entry)
_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _check_x(name: str, x: torch.Tensor, k: int) -> tuple[int, int]:
    """(M, K) of a product's input x [M, K], which must be float32, contiguous and K = ``k``
    wide (the weight's input width): the kernels read M * K floats from its pointer.

    Raises:
        ValueError: otherwise.
    """
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{name}: x must be [M, {k}] (the weight's input width), got "
                         f"{list(x.shape)}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"{name}: x must be float32 and contiguous, got {x.dtype}"
                         f"{'' if x.is_contiguous() else ' (strided)'}")
    return x.shape[0], k


def _kv_kind(dtype: torch.dtype) -> int:
    """The kernels' code for a KV cache dtype; ValueError for one they cannot read."""
    if dtype not in _KV_KINDS:
        raise ValueError(f"the CPU attention kernels read a float32, bfloat16 or int8 KV cache, "
                         f"got {dtype}")
    return _KV_KINDS[dtype]


def _is_bf16(dtype: torch.dtype) -> int:
    """1 for bfloat16, 0 for float32; ValueError for any other dtype."""
    if dtype == torch.bfloat16:
        return 1
    if dtype == torch.float32:
        return 0
    raise ValueError(f"the CPU kernels take float32 or bfloat16, got {dtype}")
