"""The fused forward pass for small steps (decodes and short chunks): quantized weights served as
they are stored, and a few fused kernel calls per layer.

Per layer, with float32 activations: [add residual +] RMSNorm (one call), the Q, K and V
projections as one quantized product (their rows concatenated), RoPE on Q and K in place, the
attention backend, the output projection, add residual + RMSNorm, gate and up as one product,
SiLU(gate) * up, the down projection. No Python work per layer grows with the batch, and the
weights stream from memory once per step in their stored format (the embedded SmolLM2: 4-bit
Q4_1 layers and the Q8_0 embedding that is also the LM head, ~100 MB against 270 MB in bf16).

Steps with more query tokens than ``max_tokens`` (prefills, long chunks) are compute-bound and go
through the dense path of the model instead (the dequantized weights in the engine's dtype, on
torch's GEMM: AMX/oneDNN where the CPU has them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sloserve.model.quant import QuantizedWeight, concat_rows


@dataclass
class FastLayer:
    """One decoder layer's weights for the fused path (norm weights and biases float32)."""

    ln1: torch.Tensor
    qkv: list[QuantizedWeight]          # one fused weight, or q, k, v when formats differ
    qkv_bias: torch.Tensor | None
    o: QuantizedWeight
    ln2: torch.Tensor
    gate_up: list[QuantizedWeight]      # one fused weight, or gate, up
    down: QuantizedWeight


class FastPath:
    """Built from a model's quantized weights (HF names) and the loaded kernels.

    Args:
        config: the model's ModelConfig.
        quantized: HF parameter name -> QuantizedWeight for every linear weight and the
            embedding (``model.embed_tokens.weight``), and ``lm_head.weight`` when untied.
        dense: the model's state (norm weights, biases), HF names.
        kernels: ``sloserve.kernels.load()``'s result.
        inv_freq: RoPE inverse frequencies [head_dim / 2] float32.
        max_tokens: steps with at most this many query tokens take this path.
    """

    def __init__(self, config, quantized: dict[str, QuantizedWeight],
                 dense: dict[str, torch.Tensor], kernels, inv_freq: torch.Tensor,
                 max_tokens: int):
        self.config, self.k, self.max_tokens = config, kernels, max_tokens
        self.inv_freq = inv_freq.float().contiguous()
        self.eps = float(config.rms_norm_eps)
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.embed = quantized["model.embed_tokens.weight"]
        self.lm_head = quantized.get("lm_head.weight", self.embed)
        self.norm = f32(dense["model.norm.weight"])
        self.layers: list[FastLayer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (quantized[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
            fused = concat_rows([q, k, v])
            bias = None
            if config.attention_bias:
                bias = torch.cat([f32(dense[f"{p}self_attn.{n}_proj.bias"]) for n in "qkv"])
            g, u = (quantized[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up"))
            gu = concat_rows([g, u])
            self.layers.append(FastLayer(
                ln1=f32(dense[p + "input_layernorm.weight"]), qkv=[fused] if fused else [q, k, v],
                qkv_bias=bias, o=quantized[f"{p}self_attn.o_proj.weight"],
                ln2=f32(dense[p + "post_attention_layernorm.weight"]),
                gate_up=[gu] if gu else [g, u], down=quantized[f"{p}mlp.down_proj.weight"]))

    @property
    def weight_bytes(self) -> int:
        """Bytes of quantized weights one step reads (layers + LM head)."""
        n = self.lm_head.nbytes
        for L in self.layers:
            n += sum(w.nbytes for w in (*L.qkv, L.o, *L.gate_up, L.down))
        return n

    def _proj(self, x: torch.Tensor, ws: list[QuantizedWeight]) -> torch.Tensor:
        if len(ws) == 1:
            return self.k.qlinear(x, ws[0])
        return torch.cat([self.k.qlinear(x, w) for w in ws], dim=1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_backend, attn_meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward``; returns [S, vocab] float32 logits."""
        k, c = self.k, self.config
        T = input_ids.shape[0]
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = k.qembed(input_ids, self.embed)          # the residual stream, float32 [T, d]
        delta = None
        for L, cache in zip(self.layers, kv_caches):
            a = k.rms_norm(h, L.ln1, self.eps) if delta is None else \
                k.add_rms_norm(h, delta, L.ln1, self.eps)
            qkv = self._proj(a, L.qkv)
            if L.qkv_bias is not None:
                qkv += L.qkv_bias
            q = qkv[:, :H * D].view(T, H, D)
            kk = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            k.rope(q, kk, positions, self.inv_freq)
            o = attn_backend.forward(q, kk, v, cache, attn_meta, D ** -0.5)
            delta = k.qlinear(o.reshape(T, H * D).float().contiguous(), L.o)
            a = k.add_rms_norm(h, delta, L.ln2, self.eps)
            delta = k.qlinear(k.silu_mul(self._proj(a, L.gate_up)), L.down)
        h += delta
        x = k.rms_norm(h.index_select(0, logits_indices), self.norm, self.eps)
        return k.qlinear(x, self.lm_head)
