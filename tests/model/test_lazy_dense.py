"""A GGUF's quantized weights get a dense copy only where a step will use it: the loader leaves
meta-device placeholders, the model dequantizes them on demand (the same values the eager
loader gives), a dense product on a weight kept only quantized fails loudly, and the measured
crossover is kept per CPU and shape."""
from __future__ import annotations

import json

import pytest
import torch

from sloserve.model import crossover
from sloserve.model.layers.linear import onednn_linear
from sloserve.model.loader import load_model


def _kernels():
    from sloserve import kernels
    k = kernels.load()
    if k is None:
        pytest.skip("no CPU kernels on this machine")
    return k


@pytest.fixture(scope="module")
def lazy(gguf_path):
    model, lw = load_model(gguf_path, "bfloat16", quantization="gguf", with_tokenizer=False,
                           dense_quantized=False)
    return model, lw


def test_the_loader_leaves_every_quantized_weight_without_a_dense_copy(lazy):
    model, lw = lazy
    assert lw.quantized and all(lw.state_dict[n].is_meta for n in lw.quantized)
    assert all(lin.weight.is_meta and lin.is_quantized for lin in model.linear_layers())
    assert model.model.embed_tokens.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert not model.has_dense_copy
    # what is left in memory: norms only (30 layers x 2 x 576 + 576 bf16 values)
    assert model.dense_weight_bytes == (30 * 2 + 1) * 576 * 2


def test_materialized_weights_equal_the_eager_loaders(gguf_path, lazy):
    model, _ = lazy
    eager, _ = load_model(gguf_path, "bfloat16", quantization="gguf", with_tokenizer=False)
    L = model.model.layers[3]
    mods = [L.self_attn.qkv_proj, L.mlp.gate_up_proj, model.model.embed_tokens]
    made = model.materialize_dense(mods)
    e = eager.model.layers[3]
    for got, want in ((L.self_attn.qkv_proj, e.self_attn.qkv_proj),
                      (L.mlp.gate_up_proj, e.mlp.gate_up_proj),
                      (model.model.embed_tokens, eager.model.embed_tokens)):
        assert not got.weight.is_meta and torch.equal(got.weight, want.weight)
    assert made == sum(m.weight.numel() * 2 for m in mods)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied to the new one
    assert model.materialize_dense(mods) == 0  # nothing left to make
    model.drop_dense(mods[:2])
    assert L.self_attn.qkv_proj.weight.is_meta and L.mlp.gate_up_proj.weight.is_meta
    assert L.self_attn.qkv_proj.weight.shape == e.self_attn.qkv_proj.weight.shape


def test_a_dense_product_on_a_weight_kept_only_quantized_fails_loudly():
    w = torch.empty(8, 4, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="a dense product of 3 rows on a weight kept only "
                                           "quantized"):
        onednn_linear(torch.zeros(3, 4), w)


def test_a_placeholder_without_a_quantized_weight_is_refused(tiny_llama_dir):
    from sloserve.model.llama import LlamaForCausalLM
    from sloserve.model.loader import load_weights
    lw = load_weights(tiny_llama_dir, "float32", with_tokenizer=False)
    name = "model.layers.0.mlp.down_proj.weight"
    sd = dict(lw.state_dict)
    sd[name] = torch.empty(sd[name].shape, device="meta")
    model = LlamaForCausalLM(lw.config)
    model.allocate(torch.float32, {name})
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight has neither "
                                         "values nor a quantized weight"):
        model.load_weights(sd.items())


def test_use_kernels_makes_no_dense_copy_where_the_quantized_weights_serve_every_step(
        gguf_path):
    """Steps of up to 64 tokens, the quantized weights serving up to 64: no dense copy (the
    other way, a crossover below the largest step, is the whole-prompt test below)."""
    quant_max = 64
    from sloserve.model.model_loader import use_kernels
    k = _kernels()
    model, _ = load_model(gguf_path, "bfloat16", quantization="gguf", with_tokenizer=False,
                          dense_quantized=False)
    use_kernels(model, k, quant_max_tokens=quant_max, amx_max_tokens=0, max_tokens=64)
    assert model.policy.quant_max_tokens == quant_max
    assert model.has_dense_copy == (quant_max < 64)
    assert model.model.embed_tokens.weight.is_meta == (quant_max >= 64)


def test_a_dense_copy_larger_than_the_memory_left_is_not_made(gguf_path, caplog):
    """A crossover below the largest step, but the dense copy over its budget (an 8B model's
    16 GB on a 24 GiB machine): no copy, every step on the quantized weights, one warning."""
    from sloserve.model.model_loader import use_kernels
    k = _kernels()
    model, _ = load_model(gguf_path, "bfloat16", quantization="gguf", with_tokenizer=False,
                          dense_quantized=False)
    need = model.dense_copy_bytes()
    assert need > 0
    use_kernels(model, k, quant_max_tokens=8, amx_max_tokens=0, max_tokens=64,
                dense_budget=lambda: need - 1)
    assert model.policy.quant_max_tokens == 64 and not model.has_dense_copy
    assert model.model.embed_tokens.weight.is_meta
    assert "every step runs on the quantized weights" in caplog.text
    model, _ = load_model(gguf_path, "bfloat16", quantization="gguf", with_tokenizer=False,
                          dense_quantized=False)
    use_kernels(model, k, quant_max_tokens=8, amx_max_tokens=0, max_tokens=64,
                dense_budget=lambda: need)  # it fits: made
    assert model.policy.quant_max_tokens == 8 and model.has_dense_copy


def test_dense_budget_is_the_memory_available_less_the_kv_cache():
    from sloserve.config import EngineConfig
    from sloserve.model.model_loader import DENSE_MARGIN_BYTES, dense_budget
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    got = dense_budget(EngineConfig(kv_cache_memory=2.0))
    assert abs(got - (avail - 2 * 2**30 - DENSE_MARGIN_BYTES)) < 2**30  # memory moves a little
    assert dense_budget(EngineConfig(num_kv_blocks=8)) - got > 1.5 * 2**30  # not counted


def test_get_model_keeps_a_dense_copy_exactly_where_the_measured_crossover_needs_one(gguf_path):
    """Whatever this CPU's crossover is (AMX hosts: the dense GEMM wins above ~16-32 tokens;
    AVX-512 hosts without AMX: the quantized product often serves every step)."""
    from sloserve.config import EngineConfig
    from sloserve.model.model_loader import get_model
    _kernels()
    budget = 24
    model, _, line = get_model(EngineConfig(model=gguf_path, max_num_batched_tokens=budget,
                                            max_num_seqs=8), torch.bfloat16)
    p = model.policy
    needs_dense = p.quant_max_tokens < budget
    assert model.has_dense_copy == needs_dense or p.amx_max_tokens > 0
    assert ("no dense copy (no step uses one" in line) == (not model.has_dense_copy)
    if not needs_dense:
        assert f"every step (<= {budget} tokens) on the quantized weights" in line


def test_crossover_cache_measures_once_per_key(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "crossovers.json"
    monkeypatch.setenv("SLOSERVE_CROSSOVER_CACHE", str(path))
    calls = []

    def measure():
        calls.append(1)
        return 96
    assert crossover._cached("a", measure) == 96 and crossover.last_source == "measured"
    assert crossover._cached("a", measure) == 96 and crossover.last_source == str(path)
    assert len(calls) == 1 and json.loads(path.read_text()) == {"a": 96}
    assert crossover._cached("b", lambda: 7) == 7  # another key: measured, both kept
    assert json.loads(path.read_text()) == {"a": 96, "b": 7}
    path.write_text("{not json")  # a damaged file is measured over
    assert crossover._cached("a", measure) == 96 and len(calls) == 2
    monkeypatch.setenv("SLOSERVE_CROSSOVER_CACHE", "off")
    assert crossover.cache_path() is None
    crossover._cached("a", measure)
    crossover._cached("a", measure)
    assert len(calls) == 4


def test_the_crossover_key_names_the_cpu_threads_shape_and_formats(lazy):
    model, _ = lazy
    key = crossover._key("quant", model, (1, 2), "x16:4b+mins:i8")
    assert key.startswith("quant|") and "|576x1536|x16:4b+mins:i8|1,2|" in key
    assert f"|{torch.get_num_threads()}|" in key and torch.__version__ in key


def test_largest_step_covers_whole_prompts_and_the_verify_cost_steps(lazy):
    """Found by a breaker run: without chunked prefill a whole prompt is one step (a 301-token
    prompt under a 64-token budget hit a weight kept only quantized), and speculative decoding
    measures steps of up to 16 tokens at start-up whatever the budget."""
    from sloserve.config import EngineConfig
    from sloserve.model.model_loader import largest_step
    model, _ = lazy
    assert largest_step(EngineConfig(max_num_batched_tokens=64), model) == 64
    assert largest_step(EngineConfig(max_num_batched_tokens=8), model) == 16
    ctx = model.config.max_position_embeddings
    assert largest_step(EngineConfig(max_num_batched_tokens=64,
                                     enable_chunked_prefill=False), model) == ctx
    assert largest_step(EngineConfig(max_num_batched_tokens=64, static_batching=True,
                                     max_model_len=1000), model) == 1000


def test_without_chunking_the_dense_copy_serves_prompts_over_the_race(gguf_path):
    """A whole-prompt step can be longer than any raced size (2,048 tokens at most): those
    steps run on the dense copy, so it is made."""
    from sloserve.config import EngineConfig
    from sloserve.model.model_loader import get_model
    _kernels()
    model, _, _ = get_model(EngineConfig(model=gguf_path, max_num_batched_tokens=8,
                                         enable_chunked_prefill=False, max_num_seqs=4),
                            torch.bfloat16)
    assert model.policy.quant_max_tokens <= 2048 and model.has_dense_copy


def test_the_cache_survives_odd_paths_and_keeps_a_concurrent_writers_entry(tmp_path,
                                                                            monkeypatch):
    import os
    d = tmp_path / "a_dir"
    d.mkdir()
    monkeypatch.setenv("SLOSERVE_CROSSOVER_CACHE", str(d))  # a directory in the way
    assert crossover._cached("k", lambda: 3) == 3
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no temp file left
    assert os.listdir(d) == []
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it for reading would block for ever
    monkeypatch.setenv("SLOSERVE_CROSSOVER_CACHE", str(fifo))
    assert crossover._cached("k", lambda: 4) == 4
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SLOSERVE_CROSSOVER_CACHE", "~/x.json")
    assert crossover.cache_path() == str(tmp_path / "x.json")
    path = tmp_path / "x.json"

    def measure_while_another_server_writes():
        path.write_text(json.dumps({"theirs": 5}))
        return 6
    assert crossover._cached("mine", measure_while_another_server_writes) == 6
    assert json.loads(path.read_text()) == {"theirs": 5, "mine": 6}
