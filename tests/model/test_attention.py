"""Attention backends against float64 dense attention, for random mixes of decodes, prefill chunks
at any offset and multi-token queries after cached context (verify steps), built through the
runner's backend-neutral step inputs; the registry; block export/import."""
from __future__ import annotations

import random

import pytest
import torch

from sloserve.model.attention import available_backends, get_attention_backend
from sloserve.model.attention import kv_int8, torch_ref
from sloserve.model.runner import build_step_inputs
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ScheduledRequest, SchedulerOutput

BS = 4


def _dense(q, k_all, v_all, start):
    """float64 attention of n queries at positions start..start+n-1 over keys 0..start+n-1."""
    n, h, d = q.shape
    g = h // k_all.shape[1]
    k = k_all.double().repeat_interleave(g, 1).transpose(0, 1)   # [H, L, D]
    v = v_all.double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) / d ** 0.5
    mask = torch.arange(k_all.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


def _random_step(rng: random.Random, n_reqs: int, num_blocks: int):
    """Random requests (cached context, query length), scattered block tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    reqs = []
    for i in range(n_reqs):
        kind = rng.choice(["decode", "first_chunk", "later_chunk", "verify"])
        done = {"decode": rng.randint(1, 30), "first_chunk": 0,
                "later_chunk": rng.randint(1, 30), "verify": rng.randint(1, 30)}[kind]
        n = {"decode": 1, "first_chunk": rng.randint(2, 12), "later_chunk": rng.randint(2, 12),
             "verify": rng.randint(2, 5)}[kind]
        nb = -(-(done + n) // BS)
        table = [free.pop() for _ in range(nb)]
        spec = [7] * (n - 1) if kind == "verify" else []
        generated = kind in ("decode", "verify")  # past the prompt
        reqs.append(ScheduledRequest(f"r{i}", done, n, [1] * n, table, SamplingParams(),
                                     samples=kind != "later_chunk" or rng.random() < 0.5,
                                     is_decode=generated, spec_token_ids=spec,
                                     num_prompt_tokens=done if generated else done + n))
    order = sorted(range(n_reqs), key=lambda i: not reqs[i].is_decode)  # decodes first
    return [reqs[i] for i in order]


def _stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` [..., D] as a cache of ``cache_dtype`` stores it (int8: quantized entries)."""
    return kv_int8.quantize(x) if cache_dtype == torch.int8 else x.to(cache_dtype)


def _read(entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache's entries hold, in ``dtype``."""
    return kv_int8.dequantize(entries, dtype) if entries.dtype == torch.int8 else entries.to(dtype)


def _check(backend_name, seed, h, n_kv, cache_dtype, act_dtype, atol, d=16,
           compute_dtype=torch.float32):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    num_blocks = 128
    backend = get_attention_backend(backend_name)
    backend.compute_dtype = compute_dtype
    width = kv_int8.entry_width(d, cache_dtype)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, BS, n_kv, width), dtype=cache_dtype)
    reqs = _random_step(rng, rng.randint(1, 6), num_blocks)
    # every request's full context K/V (float32), the cached part written into the cache
    ctx = {}
    for sr in reqs:
        kf = torch.randn(sr.end_pos, n_kv, d, generator=g)
        vf = torch.randn(sr.end_pos, n_kv, d, generator=g)
        for p in range(sr.num_computed_tokens):
            b, o = sr.block_ids[p // BS], p % BS
            cache[0, b, o], cache[1, b, o] = _stored(kf[p], cache_dtype), _stored(vf[p], cache_dtype)
        ctx[sr.request_id] = (kf, vf)
    inputs = build_step_inputs(SchedulerOutput(reqs), BS)
    q = torch.randn(inputs.num_tokens, h, d, generator=g).to(act_dtype)
    k = torch.cat([ctx[s.request_id][0][s.start_pos:] for s in reqs]).to(act_dtype)
    v = torch.cat([ctx[s.request_id][1][s.start_pos:] for s in reqs]).to(act_dtype)
    out = backend.forward(q, k, v, cache, backend.build_metadata(inputs), d ** -0.5)
    assert out.shape == q.shape and out.dtype == act_dtype
    qsl = inputs.query_start_loc.tolist()
    for b, sr in enumerate(reqs):
        kf, vf = ctx[sr.request_id]
        # the reference sees the context as the cache holds it (rounded to its dtype)
        kr, vr = (_read(_stored(x, cache_dtype), act_dtype) for x in (kf, vf))
        ref = _dense(q[qsl[b]:qsl[b + 1]], kr, vr, sr.start_pos)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]].double(), ref, atol=atol, rtol=atol)
    # the step's own K/V are in the cache now, at their slots
    flat_k = cache[0].reshape(-1, n_kv, width)
    torch.testing.assert_close(_read(flat_k[inputs.slot_mapping], torch.float32),
                               _read(_stored(k, cache_dtype), torch.float32))


BACKENDS = available_backends()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("h,n_kv", [(8, 2), (4, 1), (4, 4)])
def test_random_mixes_match_float64_dense_attention(backend, seed, h, n_kv):
    _check(backend, seed, h, n_kv, torch.float32, torch.float32, 2e-5)


@pytest.mark.parametrize("seed", range(4))
def test_without_the_flash_lse_op_the_masked_fallback_agrees(seed, monkeypatch):
    monkeypatch.setattr(torch_ref, "FLASH_CPU", None)
    _check("torch-ref", seed, 8, 2, torch.float32, torch.float32, 2e-5)


@pytest.mark.parametrize("seed", range(3))
def test_bf16_cache_and_activations(seed):
    """A bf16 cache under fp32 math and all-bf16: within bf16 rounding of the reference that
    reads the same rounded cache."""
    _check("torch-ref", seed, 8, 2, torch.bfloat16, torch.float32, 2e-2)
    _check("torch-ref", seed, 8, 2, torch.bfloat16, torch.bfloat16, 3e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("seed", range(6))
def test_cpu_paged_fused_prefill_in_random_mixes(seed, cache_dtype, monkeypatch):
    """Where the CPU has AMX or AVX512-BF16, cpu-paged in a bf16 engine runs every multi-token
    prompt chunk with head_dim 64 on the kernels' flash attention (over the bf16 cache in
    place, or over a bf16 copy of an int8 cache's context) and the decodes on its decode
    kernel: within bf16 rounding
    (q and P in bf16) of float64 attention over the values the cache holds."""
    from sloserve import kernels
    k = kernels.load()
    if k is None or k.prefill_attn_isa is None:
        pytest.skip("no AMX or AVX512-BF16 here")
    calls = []
    real = k.prefill_attn
    monkeypatch.setattr(k, "prefill_attn", lambda *a: calls.append(1) or real(*a))
    _check("cpu-paged", seed, 8, 2, cache_dtype, torch.float32, 3e-2, d=64,
           compute_dtype=torch.bfloat16)
    rng = random.Random(seed)
    kinds = [r for r in _random_step(rng, rng.randint(1, 6), 128)
             if r.num_new_tokens > 1 and not r.spec_token_ids]  # verify rows: decode kernel
    assert len(calls) == len(kinds)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("d", [16, 64, 128])
def test_int8_cache_random_mixes_match_float64_attention_over_its_values(backend, seed, d):
    """An int8 cache (codes + a scale per head and token): every backend, on random mixes,
    matches float64 attention over the values the cache holds (its dequantized entries) in
    float32; the step's own tokens attend to their stored values too. d=64 and d=128 run the
    AVX-512 decode kernel's int8 loop where the CPU has it."""
    _check(backend, seed, 9, 3, torch.int8, torch.float32, 2e-5, d=d)


def test_int8_entries_match_the_kernels_codes_and_bound_the_error():
    """The kernels' cache write stores exactly kv_int8.quantize's codes and scales (so the
    reference backend and the kernels read one format); a value is off by at most scale / 2
    (1/254 of its entry's largest magnitude); zero and NaN entries as documented."""
    from sloserve import kernels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 64, generator=g) * torch.rand(37, 3, 1, generator=g) * 10
    x[3, 1] = 0.0
    x[5, 2, 7] = float("nan")
    q = kv_int8.quantize(x)
    assert q.shape == (37, 3, 68) and q.dtype == torch.int8
    back = kv_int8.dequantize(q)
    assert torch.isnan(back[5, 2]).all() and (back[3, 1] == 0).all()
    ok = torch.ones(37, 3, dtype=torch.bool)
    ok[5, 2] = False
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= amax / 254 * (1 + 1e-6))[ok].all()
    k = kernels.load()
    if k is None:
        return
    cache = torch.zeros(2, 16, 4, 3, 68, dtype=torch.int8)
    slots = torch.randperm(64, generator=g)[:37]
    k.cache_write(x, -x, cache, slots)
    flat = cache.view(2, 64, 3, 68)
    assert torch.equal(flat[0, slots], q)
    assert torch.equal(flat[1, slots], kv_int8.quantize(-x))


def test_registry():
    assert "torch-ref" in available_backends()
    assert get_attention_backend("auto").name == available_backends()[0]
    from sloserve import kernels
    assert ("cpu-paged" in available_backends()) == (kernels.load() is not None)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'; available: auto"):
        get_attention_backend("flash")


def test_a_kv_cache_dtype_the_paged_kernels_cannot_read_gets_another_backend(tiny_llama_dir):
    """A float16 KV cache read by the cpu-paged kernels as float32 ran off the cache and
    segfaulted the engine core (a helper's ``--dtype float16``): ``auto`` now skips a backend
    that cannot read the dtype, and naming it is refused with the choices."""
    if "cpu-paged" not in available_backends():
        pytest.skip("the kernels do not load here")
    assert get_attention_backend("auto", torch.float16).name == "torch-ref"
    assert get_attention_backend("auto", torch.bfloat16).name == "cpu-paged"
    assert get_attention_backend("cpu-paged", torch.float32).name == "cpu-paged"
    with pytest.raises(ValueError, match="'cpu-paged' reads a float32, bfloat16, int8 KV cache, not "
                                         "float16; use --kv-cache-dtype float32"):
        get_attention_backend("cpu-paged", torch.float16)
    from sloserve.engine.llm import LLM
    llm = LLM(model=tiny_llama_dir, dtype="float16", num_kv_blocks=64, max_model_len=128)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].token_ids) == 4 and llm.engine.core.runner.attn_backend.name == "torch-ref"


def test_export_import_blocks_roundtrip():
    be = get_attention_backend("torch-ref")
    cache = torch.randn(be.kv_cache_shape(10, BS, 2, 8))
    buf = be.export_blocks(cache, torch.tensor([7, 2, 5]))
    assert buf.shape == (2, 3, BS, 2, 8) and buf.is_contiguous()
    other = torch.zeros_like(cache)
    be.import_blocks(other, torch.tensor([0, 1, 9]), buf)
    assert torch.equal(other[:, [0, 1, 9]], cache[:, [7, 2, 5]])
    assert other[:, 2:9].abs().sum() == 0
