"""Presets, config.json and GGUF parsing of model specs."""
import json

import pytest

from sloserve.roofline.kv import kv_bytes_per_token
from sloserve.roofline.models import PRESETS, get_model, spec_from_gguf

LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "bos_token_id": 128000,
    "eos_token_id": 128001,
}
DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
    "tie_word_embeddings": False,
}


def test_preset_parameter_counts():
    counts = {k: round(s.num_params() / 1e9, 2) for k, s in PRESETS.items()}
    assert counts == {"Llama-3-8B": 8.03, "Llama-3-70B": 70.55, "Qwen2.5-7B": 7.62, "Mistral-7B": 7.24,
                      "SmolLM2-135M": 0.13, "DeepSeek-V3": 671.03}
    assert PRESETS["SmolLM2-135M"].num_params() == 134_515_008
    assert round(PRESETS["DeepSeek-V3"].active_params() / 1e9, 1) == 37.6


def test_preset_lookup_case_insensitive():
    assert get_model("llama-3-8b") is PRESETS["Llama-3-8B"]
    with pytest.raises(KeyError):
        get_model("no-such-model")


def test_config_json_llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    s = get_model(str(tmp_path))
    p = PRESETS["Llama-3-8B"]
    for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "vocab_size"):
        assert getattr(s, f) == getattr(p, f), f
    assert s.num_params() == p.num_params()
    assert kv_bytes_per_token(s, "bf16") == 131_072


def test_config_json_deepseek_v3(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    s = get_model(str(f))
    p = PRESETS["DeepSeek-V3"]
    assert (s.mla, s.moe) == (p.mla, p.moe)
    assert s.num_params() == p.num_params()
    assert kv_bytes_per_token(s, "bf16") == 70_272


def test_config_json_unsupported(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**LLAMA3_8B_CONFIG, "model_type": "gpt2"}))
    with pytest.raises(ValueError):
        get_model(str(f))


def test_gguf(gguf_path, monkeypatch):
    s = spec_from_gguf(gguf_path)
    p = PRESETS["SmolLM2-135M"]
    assert (s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim,
            s.intermediate_size, s.vocab_size, s.tie_word_embeddings) == \
        (30, 576, 9, 3, 64, 1536, 49152, True)
    assert s.num_params() == p.num_params() == 134_515_008  # exact tensor-table count
    from sloserve.roofline import models  # .gguf paths dispatch to spec_from_gguf

    monkeypatch.setattr(models, "spec_from_gguf", lambda path: ("gguf", path))
    assert get_model(gguf_path) == ("gguf", gguf_path)
