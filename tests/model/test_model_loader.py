"""Building the served model: ``get_model`` chooses every op's implementation once (the torch
reference with --enforce-eager or without kernels, the kernels otherwise), and the model loads
Hugging Face-named weights into its fused parameters."""
from __future__ import annotations

import pytest
import torch

from sloserve.config import EngineConfig
from sloserve.model.layers.custom_op import CustomOp
from sloserve.model.layers.linear import KernelDenseLinearMethod, UnquantizedLinearMethod
from sloserve.model.model_loader import get_model


def _ops(model):
    return [m for m in model.modules() if isinstance(m, CustomOp)]


def test_enforce_eager_puts_every_op_on_the_torch_reference(tiny_llama_dir):
    model, name, line = get_model(EngineConfig(model=tiny_llama_dir, dtype="float32",
                                               enforce_eager=True), torch.float32)
    assert model.kernels is None and not model.fused_layers
    assert len(_ops(model)) == 2 * 3 + 3 and all(op.kernels is None for op in _ops(model))
    assert all(type(lin.method) is UnquantizedLinearMethod and lin.quant_method is None
               for lin in model.linear_layers())
    assert line.endswith("--enforce-eager: every step on the model's torch forward")
    assert line.startswith("weights: dense float32 (") and name


def test_kernels_serve_every_op_where_they_load(tiny_llama_dir):
    from sloserve import kernels
    k = kernels.load()
    if k is None:
        pytest.skip("no CPU kernels on this machine")
    model, _, line = get_model(EngineConfig(model=tiny_llama_dir, dtype="float32"),
                               torch.float32)
    assert model.kernels is k and all(op.kernels is k for op in _ops(model))
    assert all(type(lin.method) is KernelDenseLinearMethod and lin.quant_method is None
               for lin in model.linear_layers())
    # float32: no AMX GEMM, no quantized weights: every step dense
    assert (model.policy.quant_max_tokens, model.policy.amx_max_tokens) == (0, 0)
    assert f"fused forward on the {k.variant} kernels, every step on dense float32 GEMM" in line


def test_int8_requantized_weights_reach_every_linear_layer(tiny_llama_dir):
    """--quantization int8: each linear layer gets its parts' quantized weights (Q/K/V and
    gate/up fused into one), the LM head those of the tied embedding or its own."""
    from sloserve import kernels
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine")
    model, _, line = get_model(EngineConfig(model=tiny_llama_dir, dtype="float32",
                                            quantization="int8"), torch.float32)
    assert all(lin.is_quantized and lin.quant_method is not None
               for lin in model.linear_layers())
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert len(qkv.quant_method.weights) == 1
    assert qkv.quant_method.weights[0].shape == tuple(qkv.weight.shape)
    assert model.quantized_weight_bytes > 0 and "weights: int8 (" in line
    assert "float32 activations" in line


def test_load_weights_refuses_unknown_and_missing_parameters(tiny_llama_dir):
    from sloserve.model.llama import LlamaForCausalLM
    from sloserve.model.loader import load_weights
    lw = load_weights(tiny_llama_dir, "float32")
    sd = dict(lw.state_dict)
    with pytest.raises(ValueError, match="unexpected parameter model.layers.0.mlp.foo.weight"):
        LlamaForCausalLM(lw.config).load_weights([*sd.items(),
                                                  ("model.layers.0.mlp.foo.weight", sd[
                                                      "model.norm.weight"])])
    del sd["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight was not"):
        LlamaForCausalLM(lw.config).load_weights(sd.items())


def test_batch_invariant_serves_every_step_on_one_method(tiny_llama_dir):
    """--batch-invariant: quantized weights serve every step (no crossover, no AMX packing),
    RoPE's tables come from the per-position cache; dense weights that only oneDNN would serve
    (float32) are refused with the way out in the message."""
    from sloserve import kernels
    from sloserve.model.invariant import ALL_ROWS
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine")
    model, _, line = get_model(EngineConfig(model=tiny_llama_dir, dtype="float32",
                                            quantization="int8", batch_invariant=True),
                               torch.float32)
    assert (model.policy.quant_max_tokens, model.policy.amx_max_tokens) == (ALL_ROWS, 0)
    assert model.plan(10_000).act_dtype == torch.float32
    assert model.model.rotary_emb.table_cache is not None
    assert line.endswith("--batch-invariant: every step on the quantized weights (float32 "
                         "activations)")
    with pytest.raises(ValueError, match="oneDNN.*--quantization int8"):
        get_model(EngineConfig(model=tiny_llama_dir, dtype="float32", batch_invariant=True),
                  torch.float32)


def test_rope_table_cache_is_the_per_step_tables():
    from sloserve.model.invariant import RopeTableCache
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cache = RopeTableCache(inv)
    pos = torch.tensor([5000, 0, 17, 4095, 4096], dtype=torch.long)
    cos, sin = cache(pos)
    ang = pos.float()[:, None] * inv[None, :]
    assert cache.cos.shape[0] == 2 * RopeTableCache.CHUNK
    torch.testing.assert_close(cos, ang.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ang.sin(), atol=1e-6, rtol=0)
    assert torch.equal(cache(pos[2:3])[0], cos[2:3])  # looked up, not computed again
