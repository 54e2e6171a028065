"""The CPU kernels against torch references, for every instruction-set variant this machine can
run (an AVX-512 machine runs the AVX2 and generic builds too; an AVX2 host skips AVX-512)."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch

from sloserve import kernels
from sloserve.model.quant import QuantizedWeight, from_gguf, quantize_int4, quantize_int8
from sloserve.platform import detect_cpu

RUNNABLE = [v for v in ("generic", "avx2", "avx512")
            if v == "generic" or kernels.VARIANTS.index(kernels.best_variant(detect_cpu().flags))
            <= kernels.VARIANTS.index(v)]


@pytest.fixture(params=RUNNABLE)
def k(request):
    lib = kernels.load(request.param)
    if lib is None:
        pytest.skip(f"the {request.param} kernels could not be built here")
    assert lib.isa == {"generic": 0, "avx2": 1, "avx512": 2}[request.param]
    return lib


def _weights(kind: str, n: int, kk: int, seed: int) -> QuantizedWeight:
    w = torch.randn(n, kk, generator=torch.Generator().manual_seed(seed))
    if kind == "int4":
        return quantize_int4(w, "t")
    q = quantize_int8(w, "t")
    if kind == "int8g16":  # 16-wide groups with offsets (the Q6_K / Q2_K shape)
        d = q.scales.repeat_interleave(2, 1).contiguous() * 0.5
        return QuantizedWeight(q.qweight, d, torch.randn(d.shape) * 0.01, 8, 16, q.shape, "t")
    return q


@pytest.mark.parametrize("kind", ["int4", "int8", "int8g16"])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17])
def test_qlinear_matches_the_dequantized_product(k, kind, m):
    w = _weights(kind, 200, 576, m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(100 + m))
    y = k.qlinear(x, w)
    ref = x.double() @ w.dequantize().double().t()
    assert y.shape == (m, 200) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=2e-4, rtol=1e-5)


def _int8_activation_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """What the int8-activation products compute: x rounded per group of 32 to q = round(x * (1 /
    d)), d = max |x| / 127, both in float32 as the kernels do (at an exact .5 one code would
    otherwise differ), ties to even; a group with max |x| < 1e-30 gets d = 0 (1 / d would not be
    finite). Then in float64: integer dots with the codes, offsets times the float sums of x."""
    m, kk = x.shape
    g = x.view(m, kk // 32, 32)
    amax = g.abs().amax(-1, keepdim=True)
    ok = amax >= 1e-30
    d = torch.where(ok, amax / 127, 0)
    q = torch.round(g * torch.where(ok, 1 / torch.where(ok, d, 1), 0)).double()
    codes = w.codes().double().view(w.shape[0], kk // 32, 32)
    dots = torch.einsum("mgj,ngj->mng", q, codes)
    y = (dots * d.double().squeeze(-1)[:, None, :] * w.scales.double()[None]).sum(-1)
    if w.has_mins:
        y += g.double().sum(-1) @ w.mins.double().t()
    return y


@pytest.mark.parametrize("kind", ["int4", "int4-no-mins", "int8", "int4-f16", "int8-f16"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 15, 16, 17, 31, 100, 300])
def test_int8_activation_products_row_and_x16_layouts(k, kind, m):
    """Both layouts give the integer-exact result up to float32 rounding of the group sums
    (bound: 1e-5 of the largest output); the x16 copy holds the same codes and scales, as
    float16 where every scale and offset is exactly one (GGUF's: ``-f16``), else float32. The
    row counts cover the x16 product's passes of 16 rows and their remainders, its split of
    more than 64 rows into work items, and the threaded activation quantization (300 x 576)."""
    w = _weights("int4" if kind.startswith("int4") else "int8", 64, 576, 20 + m)
    if kind == "int4-no-mins":  # the Q4_0 shape
        w = QuantizedWeight(w.qweight, w.scales, None, 4, 32, w.shape, "t")
    if kind.endswith("-f16"):
        w = QuantizedWeight(w.qweight, w.scales.half().float(),
                            w.mins.half().float() if w.has_mins else None, w.bits, 32, w.shape, "t")
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(200 + m))
    ref = _int8_activation_reference(x, w)
    tol = 1e-5 * float(ref.abs().max())
    packed = k.pack_x16(w)
    f16 = kind.endswith("-f16")
    scale_bytes = (w.scales.numel() + (w.mins.numel() if w.has_mins else 0)) * (2 if f16 else 4)
    assert packed is not None and packed.bits == w.bits and packed.scale16 == f16
    assert packed.nbytes == w.qweight.numel() + scale_bytes
    for y in (k.qlinear_i8(x, w), k.qlinear_x16(x, packed)):
        assert y.shape == (m, 64) and y.dtype == torch.float32
        assert float((y.double() - ref).abs().max()) < tol


def test_int8_activations_of_tiny_and_non_finite_groups(k):
    """A group whose largest |x| is below 1e-30 (1 / scale would overflow) counts as zeros, in
    every build alike; a group holding inf or NaN makes its row's outputs NaN and no other row's
    (it was -inf or wrong codes in the AVX-512 build, NaN elsewhere)."""
    w = _weights("int4", 48, 576, 5)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    x[0, :32] = 0.0
    x[0, 40] = 1e-38                      # group 1: tiny, the rest of it zeros
    x[0, 64:96] *= 1e-32
    ref = _int8_activation_reference(x, w)
    for y in (k.qlinear_i8(x, w), k.qlinear_x16(x, k.pack_x16(w))):
        assert float((y.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())
    products = (lambda t: k.qlinear_i8(t, w), lambda t: k.qlinear_x16(t, k.pack_x16(w)))
    for bad in (float("inf"), float("nan")):
        xb = x.clone()
        xb[1, 100] = bad
        for f in products:
            y = f(xb)
            assert torch.isnan(y[1]).all()
            assert torch.equal(y[[0, 2]], f(x)[[0, 2]])


def test_x16_products_check_their_input(k):
    w = _weights("int4", 64, 576, 1)
    plain, fused = k.pack_x16(w), k.pack_x16_swiglu(w)
    x = torch.randn(8, 576)
    for f, p in ((k.qlinear_x16, plain), (k.qlinear_x16_swiglu, fused)):
        with pytest.raises(ValueError, match="weight's input width"):
            f(torch.randn(8, 64 * 576), p)     # read past x's end: crashed
        with pytest.raises(ValueError, match="float32 and contiguous"):
            f(x.t().contiguous().t(), p)
        with pytest.raises(ValueError, match="float32 and contiguous"):
            f(x.bfloat16(), p)
    with pytest.raises(ValueError, match="not packed by pack_x16_swiglu"):
        k.qlinear_x16_swiglu(x, plain)


@pytest.mark.parametrize("kind", ["int4", "int4-no-mins", "int8"])
@pytest.mark.parametrize("m", [0, 1, 7, 16, 17, 100])
def test_fused_swiglu_product_equals_the_product_then_silu_mul(k, kind, m):
    """The gate/up product with SiLU(gate) * up in its epilogue gives exactly (bit for bit) the
    plain x16 product followed by silu_mul; the plain product refuses the reordered weight."""
    w = _weights("int4" if kind.startswith("int4") else "int8", 96, 576, 40 + m)
    if kind == "int4-no-mins":
        w = QuantizedWeight(w.qweight, w.scales, None, 4, 32, w.shape, "t")
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(300 + m))
    fused = k.pack_x16_swiglu(w)
    assert fused is not None and fused.swiglu and fused.nbytes == w.nbytes
    y = k.qlinear_x16_swiglu(x, fused)
    assert y.shape == (m, 48)
    assert torch.equal(y, k.silu_mul(k.qlinear_x16(x, k.pack_x16(w))))
    with pytest.raises(ValueError, match="swiglu"):
        k.qlinear_x16(x, fused)


def _layer(kind: str, seed: int, d: int = 64, f: int = 96, hq: int = 4, hk: int = 2, hd: int = 16):
    """A small decoder layer's x16 weights (o, gate/up packed for SwiGLU, down, q/k/v) and
    float32 norm weights, of one kind."""
    ws = {}
    for i, (name, n, kk) in enumerate((("o", d, hq * hd), ("gate_up", 2 * f, d), ("down", d, f),
                                       ("qkv", (hq + 2 * hk) * hd, d))):
        w = _weights("int4" if kind.startswith("int4") else "int8", n, kk, seed + i)
        if kind == "int4-no-mins":
            w = QuantizedWeight(w.qweight, w.scales, None, 4, 32, w.shape, "t")
        ws[name] = w
    g = torch.Generator().manual_seed(seed)
    return ws, (torch.rand(d, generator=g) + 0.5, torch.rand(d, generator=g) + 0.5,
                torch.randn((hq + 2 * hk) * hd, generator=g) * 0.1)


@pytest.mark.parametrize("kind", ["int4", "int4-no-mins", "int8"])
@pytest.mark.parametrize("m", [0, 1, 7, 16, 17, 130])
def test_fused_layer_tail_equals_the_kernels_one_after_another(k, kind, m):
    """x16_layer_tail (the layer after attention and the next one up to its attention, in one
    call) gives bit for bit what the separate kernels give: the o product, add + RMSNorm, the
    SwiGLU product, the down product, add + RMSNorm, the q/k/v product + bias and RoPE; the last
    layer's call (no next layer) returns the down product and leaves h without it. 130 rows:
    the activation quantization splits into work items and the products into 64-row items."""
    d, f, hq, hk, hd = 64, 96, 4, 2, 16
    ws, (ln2, ln1, bias) = _layer(kind, 50 + m)
    wo, wgu, wd, wqkv = (k.pack_x16(ws["o"]), k.pack_x16_swiglu(ws["gate_up"]),
                         k.pack_x16(ws["down"]), k.pack_x16(ws["qkv"]))
    g = torch.Generator().manual_seed(m)
    o, h0 = torch.randn(m, hq * hd, generator=g), torch.randn(m, d, generator=g)
    cos, sin = k.rope_tables(torch.arange(m) + 3, 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd)))

    def separate(last: bool, b):
        h = h0.clone()
        a = k.add_rms_norm(h, k.qlinear_x16(o, wo), ln2, 1e-5)
        delta = k.qlinear_x16(k.qlinear_x16_swiglu(a, wgu), wd)
        if last:
            return h, delta
        qkv = k.qlinear_x16(k.add_rms_norm(h, delta, ln1, 1e-5), wqkv)
        if b is not None:
            qkv += b
        k.rope(qkv[:, :hq * hd].view(m, hq, hd), qkv[:, hq * hd:(hq + hk) * hd].view(m, hk, hd),
               cos, sin)
        return h, qkv

    bufs = (torch.empty(m, d), torch.empty(m, d), torch.empty(m, f))
    for b in (None, bias):
        h = h0.clone()
        out = k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, (ln1, wqkv, b),
                               (cos, sin, hq, hk, hd))
        ref_h, ref = separate(False, b)
        assert out.shape == (m, (hq + 2 * hk) * hd)
        assert torch.equal(out, ref) and torch.equal(h, ref_h)
    h = h0.clone()
    out = k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs)
    ref_h, ref = separate(True, None)
    assert torch.equal(out, ref) and torch.equal(h, ref_h)


def test_fused_layer_tail_refuses_what_does_not_fit(k):
    ws, (ln2, ln1, bias) = _layer("int4", 1)
    wo, wgu, wd, wqkv = (k.pack_x16(ws["o"]), k.pack_x16_swiglu(ws["gate_up"]),
                         k.pack_x16(ws["down"]), k.pack_x16(ws["qkv"]))
    o, h = torch.randn(4, 64), torch.randn(4, 64)
    bufs = (torch.empty(4, 64), torch.empty(4, 64), torch.empty(4, 96))
    cos, sin = k.rope_tables(torch.arange(4), torch.ones(8))
    with pytest.raises(ValueError, match="weight's input width"):
        k.x16_layer_tail(torch.randn(4, 65), h, wo, ln2, wgu, wd, 1e-5, bufs)
    bad = [dict(gate_up=k.pack_x16(ws["gate_up"])),            # not packed for SwiGLU
           dict(h=torch.randn(4, 32)), dict(h=torch.randn(5, 64)),
           dict(bufs=(torch.empty(4, 64), torch.empty(4, 64), torch.empty(4, 48))),
           dict(bufs=(torch.empty(2, 64), torch.empty(4, 64), torch.empty(4, 96))),
           dict(ln2=torch.ones(32)), dict(down=wo)]
    for change in bad:
        args = dict(h=h, gate_up=wgu, down=wd, ln2=ln2, bufs=bufs) | change
        with pytest.raises(ValueError, match="do not fit"):
            k.x16_layer_tail(o, args["h"], wo, args["ln2"], args["gate_up"], args["down"], 1e-5,
                             args["bufs"])
    with pytest.raises(ValueError, match="do not fit"):  # 3 heads' worth of q/k/v rows
        k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, (ln1, wqkv, bias), (cos, sin, 3, 2, 16))
    with pytest.raises(ValueError, match="do not fit"):
        k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, (ln1, wqkv, bias[:8]),
                         (cos, sin, 4, 2, 16))
    # a breaker helper's cases: (10, -1) heads of 16 passed the weight's row count and RoPE
    # wrote past the output (heap corruption); tables or bias of another dtype or strided were
    # read as float32; 1-D buffers and a missing rope gave IndexError / TypeError
    nxt = (ln1, wqkv, bias)
    for rope in ((cos, sin, 10, -1, 16), (cos, sin, 4, 2, 0), (cos.double(), sin.double(), 4, 2, 16),
                 (cos.bfloat16(), sin.bfloat16(), 4, 2, 16)):
        with pytest.raises(ValueError, match="do not fit"):
            k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, nxt, rope)
    for b in (bias.double(), torch.stack([bias, bias], 1)[:, 0]):
        with pytest.raises(ValueError, match="do not fit"):
            k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, (ln1, wqkv, b), (cos, sin, 4, 2, 16))
    with pytest.raises(ValueError, match="do not fit"):
        k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, (torch.empty(256), bufs[1], bufs[2]))
    with pytest.raises(ValueError, match="rope tables"):
        k.x16_layer_tail(o, h, wo, ln2, wgu, wd, 1e-5, bufs, nxt)


def test_x16_weights_own_their_c_struct(k):
    """The fused call's view of a weight lives and dies with the weight (a per-library cache of
    them had kept every engine's weights alive: ~75 MiB per LLM created and deleted)."""
    import gc
    import weakref
    w = k.pack_x16(_weights("int4", 64, 576, 2))
    st = w.c_struct
    assert (st.qw, st.bits, st.mins, st.sc16, st.N, st.K) == (w.packed.data_ptr(), 4, 1, 0, 64,
                                                                576)
    ref = weakref.ref(w)
    del w, st
    gc.collect()
    assert ref() is None


def test_fused_swiglu_packing_needs_whole_block_pairs(k):
    assert k.pack_x16_swiglu(_weights("int4", 48, 64, 1)) is None  # 24 gate rows: 1.5 blocks


def test_x16_product_of_no_rows_is_empty(k):
    packed = k.pack_x16(_weights("int4", 64, 576, 1))
    assert k.qlinear_x16(torch.zeros(0, 576), packed).shape == (0, 64)


def test_x16_refuses_rows_not_a_multiple_of_16(k):
    assert k.pack_x16(_weights("int4", 40, 64, 1)) is None
    assert k.pack_x16(_weights("int8g16", 32, 64, 1)) is None


def test_qlinear_refuses_an_unknown_format(k):
    w = _weights("int8", 8, 64, 0)
    bad = QuantizedWeight(w.qweight, w.scales, None, 8, 64, w.shape, "t")
    with pytest.raises(ValueError, match="no kernel for 8-bit weights in groups of 64"):
        k.qlinear(torch.zeros(1, 64), bad)


def test_qembed_is_the_dequantized_rows(k):
    for kind in ("int4", "int8", "int8g16"):
        w = _weights(kind, 50, 64, 3)
        ids = torch.tensor([7, 0, 49, 7])
        assert torch.equal(k.qembed(ids, w), w.dequantize()[ids])


def test_gguf_q4_1_rows_through_the_kernel(k):
    """A real GGUF encoding end to end: Q4_1 blocks -> codes -> the kernel's product."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    w = np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    qw = from_gguf(raw, "Q4_1", (64, 576))
    ref_w = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).reshape(64, 576))
    x = torch.randn(3, 576)
    torch.testing.assert_close(k.qlinear(x, qw).double(), x.double() @ ref_w.double().t(),
                               atol=2e-4, rtol=1e-5)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_norms_silu_rope(k):
    g = torch.Generator().manual_seed(1)
    x, d, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.rand(96) + .5
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5))
    h = x.clone()
    out = k.add_rms_norm(h, d, w, 1e-6)
    torch.testing.assert_close(h, x + d)
    torch.testing.assert_close(out, _rms(x + d, w, 1e-6))
    gu = torch.randn(4, 2 * 48, generator=g)
    torch.testing.assert_close(k.silu_mul(gu), torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:])
    # RoPE on strided views of a fused qkv row, as the fast path calls it
    T, H, Hk, D = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * Hk) * D, generator=g)
    q, kk = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)
    pos = torch.tensor([0, 5, 1000])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rot(t):
        return t * cos + torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1) * sin
    rq, rk, v_before = rot(q.clone()), rot(kk.clone()), qkv[:, (H + Hk) * D:].clone()
    k.rope(q, kk, *k.rope_tables(pos, inv))
    c, s_ = k.rope_tables(pos, inv)
    with pytest.raises(ValueError, match="rope: cos / sin must be contiguous float32"):
        k.rope(q, kk, c[:2], s_[:2])  # tables of another step
    torch.testing.assert_close(q, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kk, rk, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, (H + Hk) * D:], v_before)  # V untouched


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_len", [256, 7])
@pytest.mark.parametrize("lens", [[1, 7, 70, 33, 16], [70]])
@pytest.mark.parametrize("H, Hkv, bs", [(8, 2, 4), (9, 3, 16), (6, 3, 5), (4, 4, 3)])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_decode_attention_in_place(k, cache_dtype, split_len, lens, H, Hkv, bs, D):
    """Random block tables and lengths (1 to 70 tokens), GQA groups of 4, 3, 2 and 1, blocks of
    3 to 16 tokens (the AVX-512 kernel sums scores 4 tokens at a time within a block, the rest
    one by one), against float64 attention over the gathered context; a small split_len
    exercises the log-sum-exp merge. One request with one split is too few work items for every
    thread when they hold all KV heads: the kernel then splits by head, which the
    single-request case covers. Head dims 64 (Llama-3.2-1B, SmolLM2) and 128 (Llama-3 3B/8B,
    Qwen2.5): the AVX-512 kernel's two templates."""
    g = torch.Generator().manual_seed(3)
    B, nb = len(lens), 128
    cache = torch.randn(2, nb, bs, Hkv, D, generator=g).to(cache_dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, pos = [], 0
    for n in lens:
        nblk = -(-n // bs)
        tables.append(perm[pos:pos + nblk])
        pos += nblk
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(B, H, D, generator=g)
    out = k.paged_attn_decode(q, cache, bt, torch.tensor(lens), max(lens), D ** -0.5, split_len)
    for b, n in enumerate(lens):
        kc = cache[0][torch.tensor(tables[b])].reshape(-1, Hkv, D)[:n].double()
        vc = cache[1][torch.tensor(tables[b])].reshape(-1, Hkv, D)[:n].double()
        kq = kc.repeat_interleave(H // Hkv, 1).transpose(0, 1)       # [H, n, D]
        vq = vc.repeat_interleave(H // Hkv, 1).transpose(0, 1)
        s = (q[b].double()[:, None, :] @ kq.transpose(1, 2))[:, 0] * D ** -0.5
        ref = (torch.softmax(s, -1)[:, None, :] @ vq)[:, 0]
        torch.testing.assert_close(out[b].double(), ref, atol=1e-5, rtol=1e-4)


def test_cache_write_converts_and_places(k):
    cache = torch.zeros(2, 6, 4, 2, 8, dtype=torch.bfloat16)
    kv = torch.randn(3, 4, 2, 8)  # a fused buffer: k and v are strided views of it
    kk, vv = kv[:, 0], kv[:, 2]
    slots = torch.tensor([5, 0, 23])
    k.cache_write(kk, vv, cache, slots)
    flat = cache.view(2, -1, 2, 8)
    assert torch.equal(flat[0, slots], kk.to(torch.bfloat16))
    assert torch.equal(flat[1, slots], vv.to(torch.bfloat16))
    assert flat[0].abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [0, 5, 23]


def test_threads_survive_many_small_jobs_and_resizing(k):
    w = _weights("int4", 512, 64, 9)
    x = torch.randn(2, 64)
    ref = k.qlinear(x, w)
    for n in (1, 3, 2):
        k.set_num_threads(n)
        for _ in range(200):
            assert torch.equal(k.qlinear(x, w), ref)
    k.set_num_threads(torch.get_num_threads())
    assert not math.isnan(float(ref.sum()))


def test_norms_and_swiglu_in_bf16_are_the_float32_results_rounded(k):
    """The bf16 variants compute in float32 and round to nearest even once, like
    ``.to(torch.bfloat16)`` of the float32 kernel's result; a bf16 delta adds its exact value."""
    g = torch.Generator().manual_seed(5)
    T, D, F = 37, 96, 80
    x = torch.randn(T, D, generator=g) * 3
    w = torch.randn(D, generator=g)
    assert torch.equal(k.rms_norm(x, w, 1e-5, torch.bfloat16),
                       k.rms_norm(x, w, 1e-5).to(torch.bfloat16))
    delta = torch.randn(T, D, generator=g).bfloat16()
    h1, h2 = x.clone(), x.clone()
    o1 = k.add_rms_norm(h1, delta, w, 1e-5, torch.bfloat16)
    o2 = k.add_rms_norm(h2, delta.float(), w, 1e-5)
    assert torch.equal(h1, h2) and torch.equal(o1, o2.to(torch.bfloat16))
    gu = (torch.randn(T, 2 * F, generator=g) * 4).bfloat16()
    out = k.silu_mul(gu)
    assert out.dtype == torch.bfloat16 and out.shape == (T, F)
    assert torch.equal(out, k.silu_mul(gu.float()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16, got torch.float16"):
        k.rms_norm(x, w, 1e-5, torch.float16)


def _amx():
    k = kernels.load("avx512") if "avx512" in RUNNABLE else None
    if k is None or not k.amx:
        pytest.skip("no AMX here (CPU without AMX-BF16, OS without the tile state, or SLOSERVE_AMX=0)")
    return k


#: the instruction sets the bf16 prefill attention has (AMX tiles, or AVX512-BF16 without them)
PREFILL_ISAS = ["amx", "avx512_bf16"]


def _prefill(isa):
    """The kernels, where this CPU runs the prefill attention on ``isa`` (an AMX CPU runs both)."""
    k = kernels.load("avx512") if "avx512" in RUNNABLE else None
    if k is None or k.prefill_attn_isa is None or (isa == "amx" and not k.amx):
        pytest.skip(f"no {isa} prefill attention on this CPU")
    return k


@pytest.mark.parametrize("m", [1, 15, 16, 17, 31, 32, 33, 100])
@pytest.mark.parametrize("n,kk", [(48, 64), (96, 576), (80, 32)])
def test_amx_linear_is_the_bf16_product(m, n, kk):
    """Every row/column tail of the tile blocking (rows by 32 and 16, columns by 32 and 16):
    exactly x and W rounded to bf16, multiplied and summed in float32 (float64 reference)."""
    k = _amx()
    g = torch.Generator().manual_seed(1000 * m + n)
    x, w = torch.randn(m, kk, generator=g), torch.randn(n, kk, generator=g)
    y = k.amx_linear(x, k.pack_amx(w))
    ref = x.bfloat16().double() @ w.bfloat16().double().t()
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * math.sqrt(kk), rtol=1e-5)


@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 100])
@pytest.mark.parametrize("f,kk", [(48, 64), (96, 576)])
def test_amx_swiglu_is_silu_mul_of_the_product(m, f, kk):
    """The fused epilogue gives exactly silu_mul of the plain AMX product of [gate; up] (same
    tiles, same SiLU), for every row tail; gate and up are not swapped or shifted by the
    interleaving (checked against torch's SiLU on a float64 product too)."""
    k = _amx()
    g = torch.Generator().manual_seed(100 * m + f)
    x, w = torch.randn(m, kk, generator=g), torch.randn(2 * f, kk, generator=g) * 0.2
    y = k.amx_swiglu(x, k.pack_amx_swiglu(w))
    assert y.shape == (m, f) and y.dtype == torch.float32
    assert torch.equal(y, k.silu_mul(k.amx_linear(x, k.pack_amx(w))))
    p = x.bfloat16().double() @ w.bfloat16().double().t()
    ref = torch.nn.functional.silu(p[:, :f]) * p[:, f:]
    torch.testing.assert_close(y.double(), ref, atol=1e-4 * math.sqrt(kk), rtol=1e-4)
    assert k.pack_amx_swiglu(torch.zeros(48, 64)) is None  # 2F % 32: F not a whole tile
    with pytest.raises(ValueError, match="float32 and contiguous"):
        k.amx_swiglu(x.bfloat16(), k.pack_amx_swiglu(w))


def test_amx_pack_refuses_shapes_off_the_tiles():
    k = _amx()
    assert k.pack_amx(torch.zeros(40, 64)) is None   # N % 16
    assert k.pack_amx(torch.zeros(32, 48)) is None   # K % 32
    with pytest.raises(ValueError, match="input width"):
        k.amx_linear(torch.zeros(2, 32), k.pack_amx(torch.zeros(16, 64)))
    w = k.pack_amx(torch.zeros(16, 64))
    for bad in (torch.zeros(4, 64).bfloat16(), torch.zeros(8, 64)[::2], torch.zeros(64, 4).t()):
        with pytest.raises(ValueError, match="float32 and contiguous"):
            k.amx_linear(bad, w)


def test_amx_is_off_with_its_switch(monkeypatch):
    _amx()
    monkeypatch.setenv(kernels.AMX_ENV, "0")
    lib = kernels.Kernels(kernels.build("avx512"), "avx512")
    assert not lib.amx and lib.pack_amx(torch.zeros(16, 32)) is None


def _dense_attention(q, k_all, v_all, start):
    """float64 causal attention of n queries at positions start.. over keys 0..start+n-1."""
    n, h, d = q.shape
    g = h // k_all.shape[1]
    kk = k_all.double().repeat_interleave(g, 1).transpose(0, 1)
    vv = v_all.double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) * d ** -0.5
    mask = torch.arange(k_all.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    return (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv).transpose(0, 1)


@pytest.mark.parametrize("n,past", [(2, 0), (16, 0), (17, 5), (64, 0), (65, 63), (100, 300),
                                    (3, 700)])
@pytest.mark.parametrize("h,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 32, 5), (4, 4, 128, 16)])
@pytest.mark.parametrize("isa", PREFILL_ISAS)
def test_prefill_attention_is_causal_attention_over_the_paged_context(n, past, h, hkv, d, bs, isa):
    """Chunks at any offset (tiles of 16 queries, context blocks of 64 and their tails, block
    tables scattered, blocks of 5 tokens that straddle the 64-token blocks): float64 attention
    over the bf16 cache, queries rounded to bf16 as the kernel rounds them."""
    k = _prefill(isa)
    g = torch.Generator().manual_seed(n * 1000 + past + d)
    ctx = past + n
    nb = -(-ctx // bs) + 8
    cache = torch.randn(2, nb, bs, hkv, d, generator=g).bfloat16()
    blocks = torch.randperm(nb, generator=g)[:-(-ctx // bs)].contiguous()
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g)   # q a strided view, as in the engine
    q = qkv[:, :h]
    out = k.prefill_attn(q, cache, blocks, past, d ** -0.5, isa=isa)
    kv = cache[:, blocks].reshape(2, -1, hkv, d)[:, :ctx]
    ref = _dense_attention(q.bfloat16(), kv[0], kv[1], past)
    assert out.shape == (n, h, d) and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("n,past", [(16, 0), (64, 0), (100, 300), (3, 700)])
@pytest.mark.parametrize("rise", [0.5, 4.0])
@pytest.mark.parametrize("isa", PREFILL_ISAS)
def test_prefill_attention_with_scores_that_rise_along_the_context(n, past, rise, isa):
    """Keys scaled up along the context, so that later 64-token blocks hold larger scores: the
    kernel raises its softmax reference (and rescales what it has summed) only when a block's
    max passes it by more than 2^8, and the output must not depend on when that happens
    (rise 0.5: scores up to ~30 log2 units, a raise or two; 4.0: up to ~200, a raise in nearly
    every block)."""
    k = _prefill(isa)
    h, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(n * 7 + past)
    ctx = past + n
    nb = -(-ctx // bs) + 8
    cache = torch.randn(2, nb, bs, hkv, d, generator=g)
    blocks = torch.randperm(nb, generator=g)[:-(-ctx // bs)].contiguous()
    ramp = 1 + rise * torch.arange(ctx, dtype=torch.float32) / 64          # per position
    flat = torch.zeros(nb * bs)
    slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[:ctx]
    flat[slots] = ramp
    cache[0] *= flat.view(nb, bs, 1, 1)
    cache = cache.bfloat16()
    q = torch.randn(n, h, d, generator=g)
    out = k.prefill_attn(q, cache, blocks, past, d ** -0.5, isa=isa)
    kv = cache[:, blocks].reshape(2, -1, hkv, d)[:, :ctx]
    # the kernel rounds q * scale * log2(e) to bf16; at scores of ~100 the reference must too
    c = d ** -0.5 * 1.4426950408889634
    ref = _dense_attention((q * c).bfloat16().double() / c, kv[0], kv[1], past)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("isa", PREFILL_ISAS)
def test_prefill_attention_refuses_what_it_cannot_read(isa):
    """Each of these crashed the process or read outside the cache before the wrapper checked
    it (a helper's report): int32 / strided / out-of-range block tables, bf16 q, negative
    cached counts."""
    k = _prefill(isa)
    cache = torch.zeros(2, 4, 16, 1, 64).bfloat16()
    q = torch.zeros(3, 2, 64)
    for bad in (torch.arange(4, dtype=torch.int32), torch.arange(8)[::2],
                torch.tensor([0, 4]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError):
            k.prefill_attn(q, cache, bad, 20, 0.125, isa=isa)
    with pytest.raises(ValueError, match="float32"):
        k.prefill_attn(q.bfloat16(), cache, torch.arange(4), 0, 0.125, isa=isa)
    with pytest.raises(ValueError, match="cached"):
        k.prefill_attn(q, cache, torch.arange(4), -2, 0.125, isa=isa)
    with pytest.raises(ValueError, match="blocks"):
        k.prefill_attn(q, cache, torch.arange(1), 20, 0.125, isa=isa)  # 23 positions, 16 cached
    with pytest.raises(ValueError, match="bf16"):
        k.prefill_attn(q, cache.float(), torch.arange(4), 0, 0.125, isa=isa)
    # a view of a bigger cache (wrong values), or a stride-0 K/V plane (read past the end and
    # crashed; a helper's report)
    big = torch.zeros(2, 8, 16, 2, 64).bfloat16()
    for view in (big[:, :4, :, :1], cache[:1].expand(2, 4, 16, 1, 64)):
        with pytest.raises(ValueError, match="contiguous"):
            k.prefill_attn(q, view, torch.arange(4), 0, 0.125, isa=isa)
    with pytest.raises(ValueError, match="int"):
        k.prefill_attn(q, cache, torch.arange(4), 3.0, 0.125, isa=isa)
    with pytest.raises(ValueError, match="bf16"):
        k.prefill_attn(torch.zeros(3, 2, 48), torch.zeros(2, 4, 16, 1, 48).bfloat16(),
                       torch.arange(4), 0, 0.125, isa=isa)


def test_prefill_attention_refuses_an_isa_this_cpu_lacks(monkeypatch):
    """AMX asked for where the tiles are off (``SLOSERVE_AMX=0`` or a CPU without them), or a
    name it does not know: a ValueError naming the choice, never an illegal instruction."""
    k = _prefill("avx512_bf16")
    monkeypatch.setattr(k, "amx", False)
    cache, q = torch.zeros(2, 4, 16, 1, 64).bfloat16(), torch.zeros(3, 2, 64)
    for isa in ("amx", "avx2"):
        with pytest.raises(ValueError, match=f"isa '{isa}' is not available"):
            k.prefill_attn(q, cache, torch.arange(4), 0, 0.125, isa=isa)


# ------------------------------------------------------------------ --batch-invariant
# The kernels --batch-invariant relies on (sloserve.model.invariant) give each row the same
# bits whatever the other rows of the call, their number and the thread count: the quantized
# products (x16 and row layouts, int8 or float32 activations), the AMX GEMM, the paged decode
# attention per row, and the prefill attention's invariant variant per query token whatever
# chunk it comes in. Exact equality: that is the property.

#: row subsets of a 150-row input: single rows, tails of a 16-row tile, several tiles
SUBSETS = [(0, 1), (149, 150), (5, 8), (16, 33), (40, 104), (0, 150)]


@contextlib.contextmanager
def kernel_threads(k, n: int):
    before = k.lib.sl_num_threads()
    k.set_num_threads(n)
    try:
        yield
    finally:
        k.set_num_threads(before)


def _rows_invariant(k, fn, x: torch.Tensor) -> None:
    """fn's rows of every subset of x, on 1 and 3 threads, are the full call's rows."""
    full = fn(x)
    for threads in (1, 3):
        with kernel_threads(k, threads):
            for a, b in SUBSETS:
                assert torch.equal(fn(x[a:b].contiguous()), full[a:b]), (a, b, threads)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_products_rows(k, kind):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 576, generator=g)
    qw = quantize_int4(w, "t") if kind == "int4" else quantize_int8(w, "t")
    x = torch.randn(150, 576, generator=g) * 3
    _rows_invariant(k, lambda t: k.qlinear(t, qw), x)          # float32 activations
    _rows_invariant(k, lambda t: k.qlinear_i8(t, qw), x)       # int8, row layout
    x16 = k.pack_x16(qw)
    _rows_invariant(k, lambda t: k.qlinear_x16(t, x16), x)     # int8, x16 layout
    sw = k.pack_x16_swiglu(qw)
    _rows_invariant(k, lambda t: k.qlinear_x16_swiglu(t, sw), x)


def test_amx_gemm_rows():
    k = _amx()
    g = torch.Generator().manual_seed(4)
    w = k.pack_amx(torch.randn(96, 576, generator=g).bfloat16())
    _rows_invariant(k, lambda t: k.amx_linear(t, w), torch.randn(150, 576, generator=g))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_paged_decode_rows(k, cache_dtype):
    """A query row's output with its context length is the same alone, among rows of other
    lengths (one to eight splits of 64) and on another thread count."""
    g = torch.Generator().manual_seed(5)
    h, hkv, d, bs, nb = 9, 3, 64, 16, 40
    width = d + 4 if cache_dtype == torch.int8 else d
    cache = torch.empty(2, nb, bs, hkv, width, dtype=cache_dtype)
    kv = torch.randn(nb * bs, hkv, d, generator=g)
    k.cache_write(kv, kv * 0.5, cache, torch.arange(nb * bs))
    lens = torch.tensor([1, 7, 64, 65, 300, 511, 130, 2, 640, 33])
    table = torch.stack([torch.randperm(nb, generator=g) for _ in lens])
    q = torch.randn(len(lens), h, d, generator=g)
    full = k.paged_attn_decode(q, cache, table, lens, int(lens.max()), 0.125, 64)
    for threads in (1, 3):
        with kernel_threads(k, threads):
            for i in range(len(lens)):
                one = k.paged_attn_decode(q[i:i + 1].contiguous(), cache, table[i:i + 1],
                                          lens[i:i + 1], int(lens[i]), 0.125, 64)
                assert torch.equal(one[0], full[i]), (i, threads)


@pytest.mark.parametrize("h,hkv,d,bs", [(9, 3, 64, 16), (4, 1, 32, 5)])
@pytest.mark.parametrize("isa", PREFILL_ISAS)
def test_invariant_prefill_attention_is_the_same_in_every_chunking(isa, h, hkv, d, bs):
    """A prompt of 300 tokens cut into chunks five ways (one-token chunks, chunks off the
    16-token tiles and the 64-token context blocks): every token's output is bit-identical
    with the invariant variant, on 1 and 3 threads; and it is as close to causal attention
    as the default variant (the scores are large here, so that the softmax's reference moves
    often: bf16 queries and probabilities then err by ~0.1 in either variant)."""
    k = _prefill(isa)
    g = torch.Generator().manual_seed(6)
    n = 300
    nb = -(-n // bs) + 4
    cache = (torch.randn(2, nb, bs, hkv, d, generator=g) * 2).bfloat16()
    blocks = torch.randperm(nb, generator=g)[:-(-n // bs)].contiguous()
    q = torch.randn(n, h, d, generator=g) * 3

    def chunked(cuts):
        outs, p = [], 0
        for c in cuts:
            outs.append(k.prefill_attn(q[p:p + c], cache, blocks, p, d ** -0.5, isa=isa,
                                       invariant=True))
            p += c
        return torch.cat(outs)
    full = chunked([n])
    for threads in (1, 3):
        with kernel_threads(k, threads):
            for cuts in ([1, 299], [17, 100, 183], [64, 1, 1, 234], [299, 1], [5] * 60):
                assert torch.equal(chunked(cuts), full), (cuts, threads)
    kv = cache[:, blocks].reshape(2, -1, hkv, d)[:, :n]
    ref = _dense_attention(q.bfloat16(), kv[0], kv[1], 0)
    default = k.prefill_attn(q, cache, blocks, 0, d ** -0.5, isa=isa)
    err = float((full.double() - ref).abs().max())
    assert err <= 1.25 * float((default.double() - ref).abs().max()) + 1e-3, err
