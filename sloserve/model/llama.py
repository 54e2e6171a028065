"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen2 over the paged KV cache.

Parameter names equal Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM so checkpoints load
with `load_state_dict(strict=True)`. The forward pass works on a flattened mixed batch: T tokens
from any number of requests (decodes and prefill chunks) in one pass.
"""
from __future__ import annotations

import torch
from torch import nn

from typing import Any

from sloserve.model.attention import AttentionBackend
from sloserve.model.config import ModelConfig
from sloserve.model.layers import MLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    """Multi-head / grouped-query attention (Ainslie et al. 2023) with RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        d = config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos_sin, kv_cache, backend: AttentionBackend, meta: Any):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
        q, k = RotaryEmbedding.apply(q, k, *cos_sin)
        o = backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.n_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). [T, d] -> [T, d]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache, backend, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. Build with a ModelConfig, then load a Hugging Face-named state dict."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryEmbedding(config)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]: the embedding matrix when tied, else lm_head's."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_backend: AttentionBackend, attn_meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """One step over a flattened batch.

        Args:
            input_ids: [T] int64 token ids.
            positions: [T] int64 position of each token in its request.
            kv_caches: one tensor per layer, in ``attn_backend``'s layout.
            attn_backend: computes attention (and owns the cache layout).
            attn_meta: ``attn_backend.build_metadata(...)`` of this step.
            logits_indices: [S] int64 rows of T whose next-token logits are needed.

        Returns:
            [S, vocab_size] float32 logits.
        """
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, cos_sin, kv, attn_backend, attn_meta)
        x = self.model.norm(x[logits_indices])
        return (x @ self.lm_head_weight.t()).float()
