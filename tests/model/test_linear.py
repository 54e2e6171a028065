"""The linear layers' dense method on the kernels: 16-bit oneDNN GEMMs run at a bounded set of
row counts; the AMX GEMM serves the calls up to ``amx_max_tokens`` rows where the CPU has it;
the start-up warm-up runs every oneDNN shape a step can take."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sloserve.model import model_loader
from sloserve.model.layers import linear as linear_mod
from sloserve.model.layers.linear import (KernelDenseLinearMethod, LinearPolicy, dense_rows,
                                          onednn_linear)


def test_dense_rows_buckets():
    assert [dense_rows(t) for t in (1, 2, 3, 5, 9, 17, 32, 33, 64, 65, 256, 257, 320, 321)] == \
        [1, 2, 4, 8, 16, 32, 32, 64, 64, 96, 256, 320, 320, 384]
    for t in range(1, 2049):
        r = dense_rows(t)
        assert t <= r and (r == t or dense_rows(r) == r)  # a bucket maps to itself
    assert len({dense_rows(t) for t in range(1, 513)}) == 17
    assert len({dense_rows(t) for t in range(1, 2049)}) == 41


@pytest.mark.parametrize("tokens", [1, 3, 33, 100, 257])
def test_padded_bf16_product_is_the_rows_product(tokens):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64)
    w1 = torch.randn(48, 64).bfloat16()
    out = onednn_linear(x, w1)
    assert out.shape == (tokens, 48) and out.dtype == torch.float32
    ref = F.linear(x.bfloat16(), w1).float()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)  # bf16 output rounding


def test_float32_is_not_padded():
    x, w = torch.randn(33, 64), torch.randn(48, 64)
    assert torch.equal(onednn_linear(x, w), F.linear(x, w))


def test_bf16_gemm_sees_bucketed_rows(monkeypatch):
    seen, real = [], F.linear

    def linear(x, w):
        seen.append(x.shape[0])
        return real(x, w)
    monkeypatch.setattr(linear_mod.F, "linear", linear)
    w = torch.randn(8, 16).bfloat16()
    for t in (5, 6, 7, 40, 50):
        onednn_linear(torch.randn(t, 16), w)
    assert seen == [8, 8, 8, 64, 64]


def test_bf16_output_is_the_float32_output_rounded_back():
    x, w = torch.randn(33, 64), torch.randn(48, 64).bfloat16()
    out = onednn_linear(x, w, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 48) and out.is_contiguous()
    assert torch.equal(out.float(), onednn_linear(x, w))
    assert torch.equal(onednn_linear(x.bfloat16(), w), onednn_linear(x, w))


def test_dense_product_goes_to_amx_up_to_its_crossover(monkeypatch):
    """Rows <= amx_max_tokens on the AMX GEMM with the weight's packed twin, float32 (or
    rounded to the requested dtype); more rows on oneDNN; the bias added to either."""
    calls = []
    w = torch.randn(48, 64).bfloat16()
    twin = object()
    k = SimpleNamespace(amx_linear=lambda x, a: (calls.append((x.shape[0], x.dtype, a)),
                                                 torch.ones(x.shape[0], 48))[1])
    method = KernelDenseLinearMethod(k, LinearPolicy(quant_max_tokens=0, amx_max_tokens=32),
                                     amx=twin)
    layer = SimpleNamespace(weight=w, bias_f32=None)
    y = method.apply(layer, torch.randn(32, 64).bfloat16(), out_dtype=torch.bfloat16)
    assert calls == [(32, torch.float32, twin)] and y.dtype == torch.bfloat16
    assert torch.equal(y.float(), torch.ones(32, 48))
    x = torch.randn(33, 64)
    y = method.apply(layer, x)
    assert len(calls) == 1 and torch.equal(y, onednn_linear(x, w))  # oneDNN
    layer.bias_f32 = torch.arange(48, dtype=torch.float32)
    y = method.apply(layer, torch.randn(2, 64))
    assert torch.equal(y, torch.ones(2, 48) + layer.bias_f32)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "onednn"])
def test_bf16_dense_steps_match_the_reference_model(tiny_llama_dir, amx, monkeypatch):
    """A bfloat16 engine's dense steps (on the AMX GEMM where the CPU has it, float32 between
    kernels; on oneDNN with GEMM inputs and outputs kept in bf16 between the norm, SwiGLU and
    residual kernels) give the greedy tokens of the plain torch model (--enforce-eager) in the
    same dtype, over 40-token prompts and 8 decode steps."""
    from sloserve import kernels
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.sampling_params import SamplingParams
    k = kernels.load()
    if amx and not (k is not None and k.amx):
        pytest.skip("no AMX on this CPU (or SLOSERVE_AMX=0)")
    if k is not None and not amx:
        monkeypatch.setattr(k, "amx", False)
    if amx:  # the start-up race can go to oneDNN on a loaded host (a newcomer's run: 0 tokens)
        from sloserve.model import crossover
        monkeypatch.setattr(crossover, "amx_crossover", lambda model: 2048)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40)] for i in range(3)]
    outs = []
    for eager in (False, True):
        eng = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="bfloat16", num_kv_blocks=32,
                                     enable_prefix_caching=False, enforce_eager=eager))
        assert (eng.runner.model.kernels is None) == eager
        if not eager:
            assert (eng.runner.model.policy.amx_max_tokens > 0) == amx
        ids = [eng.add_request(p, sp) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        outs.append([done[i] for i in ids])
    assert outs[0] == outs[1] and all(len(t) == 8 for t in outs[0])


def _record_linear(monkeypatch) -> list:
    """The (rows, weight shape) of every F.linear the warm-up runs, in order."""
    seen, real = [], F.linear

    def linear(x, w):
        seen.append((x.shape[0], tuple(w.shape)))
        return real(x, w)
    monkeypatch.setattr(model_loader.F, "linear", linear)
    return seen


def _tiny_bf16_model(quant_max_tokens: int, amx_max_tokens: int, quantized: bool):
    """A 2-layer model (hidden 8, 4 query heads and 1 KV head of 2, intermediate 16, vocab 50:
    layer weights qkv [12, 8], o [8, 8], gate_up [32, 8], down [8, 16]) in bfloat16, set up as
    the kernels would leave it (its crossovers given; an LM head with or without quantized
    weights)."""
    from sloserve.model.config import ModelConfig
    from sloserve.model.llama import LlamaForCausalLM
    cfg = ModelConfig(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.kernels = object()
    model.policy.quant_max_tokens, model.policy.amx_max_tokens = quant_max_tokens, amx_max_tokens
    model.lm_head.quant_method = object() if quantized else None
    return model


def test_warm_up_runs_every_dense_shape_a_step_can_take(monkeypatch):
    """Every (bucketed rows, weight) product a step of up to 100 tokens can run on the dense
    path (above the quantized steps' 8 tokens), and the LM head's up to 40 sampled rows, once:
    the buckets of 9..100 tokens are 16, 32, 64, 96, 128; of 9..40 sampled rows 16, 32, 64."""
    seen = _record_linear(monkeypatch)
    runs = model_loader.warm_up(_tiny_bf16_model(8, 0, quantized=True), 100, 40)
    layer_shapes = {(12, 8), (8, 8), (32, 8), (8, 16)}
    want = {(r, s) for r in (16, 32, 64, 96, 128) for s in layer_shapes} | \
        {(r, (50, 8)) for r in (16, 32, 64)}
    assert sorted(seen) == sorted(want) and runs == len(want) == 23
    seen.clear()
    fp32 = _tiny_bf16_model(8, 0, quantized=True).float()
    assert model_loader.warm_up(fp32, 100, 40) == 0 and seen == []
    torch_ref = _tiny_bf16_model(8, 0, quantized=True)
    torch_ref.kernels = None
    assert model_loader.warm_up(torch_ref, 100, 40) == 0 and seen == []


def test_warm_up_skips_the_steps_the_amx_gemm_serves(monkeypatch):
    """With AMX up to 40 tokens, only 41..100-token steps (buckets 64, 96, 128) and 41..60
    sampled rows (64) reach oneDNN; without quantized weights the LM head starts there too."""
    seen = _record_linear(monkeypatch)
    for quantized in (True, False):
        seen.clear()
        model = _tiny_bf16_model(8 if quantized else 0, 40, quantized)
        layer_shapes = [(12, 8), (8, 8), (32, 8), (8, 16)]
        assert model_loader.warm_up(model, 100, 60) == 3 * 4 + 1
        assert sorted(seen) == sorted([(r, s) for r in (64, 96, 128) for s in layer_shapes]
                                      + [(64, (50, 8))])
