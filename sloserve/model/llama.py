"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral) and Qwen2 over the paged KV cache, written
once from the layers in :mod:`sloserve.model.layers`.

The forward pass works on a flattened mixed batch: T tokens from any number of requests
(decodes and prefill chunks) in one pass. Each op runs its torch reference or its kernel
implementation (chosen once, at build: ``sloserve.model.model_loader.get_model``), each linear
layer its quantized or dense method by the step's token count. On the kernels the residual
stream is float32, Q/K/V, RoPE and attention are float32, and the activations between GEMMs
are float32 or, on a bfloat16 oneDNN step, bfloat16 (:meth:`LlamaForCausalLM.plan`).

Parameters follow Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM names but for the fused
``qkv_proj`` (q/k/v_proj) and ``gate_up_proj`` (gate/up_proj); :meth:`LlamaForCausalLM.
load_weights` takes the Hugging Face names (``packed_modules_mapping``, as vLLM and nano-vllm do).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sloserve.model.config import ModelConfig
from sloserve.model.layers.activation import SiluAndMul
from sloserve.model.layers.attention import Attention
from sloserve.model.layers.layernorm import RMSNorm
from sloserve.model.layers.linear import (LinearPolicy, MergedColumnLinear, QKVLinear,
                                          ReplicatedLinear)
from sloserve.model.layers.rotary_embedding import RotaryEmbedding
from sloserve.model.layers.vocab_embedding import LMHead, VocabEmbedding


@dataclass
class StepPlan:
    """What a step of T tokens runs on, decided once per step.

    Attributes:
        act_dtype: the activations handed between GEMMs, norms and SwiGLU.
        float_dtype: Q/K/V, RoPE, the attention output and the final norm (float32 on the
            kernels, the model's dtype on the torch reference).
        fused: each layer after its attention is one whole-layer kernel call.
    """

    act_dtype: torch.dtype
    float_dtype: torch.dtype
    fused: bool = False


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        H, Hkv, D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.q_size, self.kv_size = H * D, Hkv * D
        self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
        self.qkv_proj = QKVLinear(config.hidden_size, D, H, Hkv, bias=config.attention_bias)
        self.o_proj = ReplicatedLinear(H * D, config.hidden_size)
        self.attn = Attention(H, Hkv, D)

    def split(self, qkv: torch.Tensor):
        """qkv [T, (H + 2 H_kv) D] -> views q [T, H, D], k and v [T, H_kv, D]."""
        T, D = qkv.shape[0], self.head_dim
        q = qkv[:, :self.q_size].view(T, self.num_heads, D)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, self.num_kv_heads, D)
        v = qkv[:, self.q_size + self.kv_size:].view(T, self.num_kv_heads, D)
        return q, k, v


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020). [T, d] -> [T, d]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(d, [f, f])
        self.down_proj = ReplicatedLinear(f, d)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.swiglu(x, self.act_fn, act_dtype), act_dtype)

    __call__ = forward  # without nn.Module's hook machinery: called per layer


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        #: the whole-layer kernel call (``sloserve.model.layers.fused_layer``), or None
        self.fused = None


class LlamaModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.kernels = None  # set where the whole-layer kernel call is used

    def forward(self, input_ids, positions, kv_caches, attn_backend, attn_meta,
                logits_indices, plan: StepPlan, num_layers: int | None = None,
                layer_hooks=None) -> torch.Tensor:
        """The final norm's output at ``logits_indices``, [S, hidden], after the first
        ``num_layers`` layers (None: all; ``layer_skip`` drafts stop early). ``layer_hooks``
        (a KV connector's worker half) is told before each layer's attention reads the cache
        (``wait_for_layer_load(i)``) and after it wrote the layer's KV (``save_kv_layer(i)``)."""
        act, fdt = plan.act_dtype, plan.float_dtype
        hidden = self.embed_tokens(input_ids)
        residual = None
        tables = self.rotary_emb(positions, fdt)  # once for all layers
        qkv = None  # the next layer's RoPE'd Q/K/V, made by a whole-layer kernel call
        if plan.fused:
            T, d = hidden.shape
            bufs = (torch.empty(T, d), torch.empty(T, d),
                    torch.empty(T, self.layers[0].mlp.down_proj.input_size))
            run_layer = self.kernels.run_x16_layer
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for i, (layer, cache) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn
            if qkv is None:
                hidden, residual = layer.input_layernorm(hidden, residual, act)
                q, k, v = attn.split(attn.qkv_proj(hidden, fdt))
                q, k = self.rotary_emb.rotate(q, k, tables)
            else:
                q, k, v = attn.split(qkv)
            if layer_hooks is not None:
                layer_hooks.wait_for_layer_load(i)
            o = attn.attn(q, k, v, cache, attn_backend, attn_meta).to(fdt).contiguous()
            if layer_hooks is not None:
                layer_hooks.save_kv_layer(i)
            if plan.fused:
                out = run_layer(layer.fused, o, residual, bufs, *tables)
                qkv, hidden = (out, None) if layer.fused.nxt else (None, out)
                continue
            hidden = attn.o_proj(o, act)
            hidden, residual = layer.post_attention_layernorm(hidden, residual, act)
            hidden = layer.mlp(hidden, act)
        residual += hidden
        return self.norm(residual.index_select(0, logits_indices), None, fdt)[0]


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM. Build with a ModelConfig, then :meth:`load_weights` (Hugging Face
    names); ``sloserve.model.model_loader`` then chooses each op's implementation."""

    #: Hugging Face module name -> (this model's fused module, its part)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        #: set by the model loader where the ops run on the kernels
        self.kernels = None
        #: the token-count crossovers every linear layer of this model follows
        self.policy = LinearPolicy()
        #: the whole-layer kernel call serves every quantized step
        self.fused_layers = False

    def linear_layers(self) -> list:
        """Every linear layer: each decoder layer's (Q/K/V, o, gate/up, down), then the LM
        head."""
        out = []
        for L in self.model.layers:
            out += [L.self_attn.qkv_proj, L.self_attn.o_proj, L.mlp.gate_up_proj,
                    L.mlp.down_proj]
        return out + [self.lm_head]

    @property
    def quantized_weight_bytes(self) -> int:
        """Bytes of weights a quantized step reads (layers + LM head, as the kernels hold
        them); 0 without quantized weights on the kernels."""
        return sum(lin.quant_method.nbytes for lin in self.linear_layers()
                   if lin.quant_method is not None)

    def _param_target(self, name: str) -> tuple[str, Any]:
        """A Hugging Face parameter name -> (this model's parameter name, part or None)."""
        for hf, (fused, shard) in self.packed_modules_mapping.items():
            if f".{hf}." in name:
                return name.replace(f".{hf}.", f".{fused}."), shard
        return name, None

    def allocate(self, dtype: torch.dtype, absent: set[str] = frozenset()) -> None:
        """Give every parameter its storage in ``dtype`` (untouched until loaded), except those
        fed only by the Hugging Face names in ``absent``: they go to the meta device (no
        memory) until :meth:`materialize_dense` makes them. Replaces ``.to(dtype)`` for the
        parameters, which would first write a float32 copy of every weight."""
        meta = {self._param_target(n)[0] for n in absent}
        for name, p in list(self.named_parameters()):
            mod_name, attr = name.rsplit(".", 1)
            new = nn.Parameter(torch.empty(p.shape, dtype=dtype,
                                           device="meta" if name in meta else "cpu"))
            if hasattr(p, "weight_loader"):
                new.weight_loader = p.weight_loader
            setattr(self.get_submodule(mod_name), attr, new)
        if self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def materialize_dense(self, modules=None) -> int:
        """Dequantize the dense weight of each of ``modules`` (default: the embedding and every
        linear layer) still on the meta device (see :meth:`allocate`), as the loader would
        have (the served values, in the model's dtype). Returns the bytes made."""
        embed = self.model.embed_tokens
        mods = [embed, *self.linear_layers()] if modules is None else modules
        made = 0
        for m in mods:
            if not m.weight.is_meta:
                continue
            parts = m.quantized if isinstance(m.quantized, list) else [m.quantized]
            w = torch.cat([q.dequantize() for q in parts]).to(m.weight.dtype)
            new = nn.Parameter(w)
            if hasattr(m.weight, "weight_loader"):
                new.weight_loader = m.weight.weight_loader
            m.weight = new
            made += w.numel() * w.element_size()
            if m is embed and self.config.tie_word_embeddings:
                self.lm_head.tie_to(embed)
        return made

    def drop_dense(self, modules) -> None:
        """Put the dense weight of each of ``modules`` back on the meta device (they keep their
        quantized weights): what :meth:`materialize_dense` made for a start-up measurement
        and no step will use."""
        for m in modules:
            if m.quantized is None or (isinstance(m.quantized, list) and None in m.quantized):
                continue
            w = m.weight
            new = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"))
            if hasattr(w, "weight_loader"):
                new.weight_loader = w.weight_loader
            m.weight = new

    @property
    def has_dense_copy(self) -> bool:
        """Every linear layer holds its dense weight (none left on the meta device)."""
        return not any(lin.weight.is_meta for lin in self.linear_layers())

    def dense_copy_bytes(self) -> int:
        """Bytes :meth:`materialize_dense` would make now (the embedding's and linear layers'
        weights still on the meta device, in their dtype)."""
        mods = [self.model.embed_tokens, *self.linear_layers()]
        return sum(m.weight.numel() * m.weight.element_size() for m in mods if m.weight.is_meta)

    @property
    def dense_weight_bytes(self) -> int:
        """Bytes of the dense weights held in memory (those on the meta device count 0)."""
        return sum(p.numel() * p.element_size() for p in self.parameters() if not p.is_meta)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     quantized: dict | None = None) -> None:
        """Copy Hugging Face-named tensors into the parameters (fused ones part by part) and
        hand each layer its quantized weights (``quantized``: HF name -> QuantizedWeight).

        Raises:
            ValueError: an unknown name, a part given twice, a parameter left without values
                or a shape that does not fit.
        """
        params = dict(self.named_parameters())
        filled: dict[str, set] = {}
        fused = set()
        for name, w in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                raise ValueError("lm_head.weight given for a model with tied embeddings")
            target, shard = self._param_target(name)
            p = params.get(target)
            if p is None:
                raise ValueError(f"unexpected parameter {name}")
            got = filled.setdefault(target, set())
            if shard in got:
                raise ValueError(f"parameter {name} given twice")
            got.add(shard)
            if w.is_meta:  # no dense copy given: the parameter stays on the meta device
                if not p.is_meta:
                    raise ValueError(f"{name}: no values given (a placeholder) for a parameter "
                                     f"that has storage")
                if shard is not None:
                    fused.add(target)
                continue
            if shard is None:
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: shape {tuple(w.shape)}, expected {tuple(p.shape)}")
                with torch.no_grad():
                    p.data.copy_(w)
            else:
                p.weight_loader(p, w, shard)
                fused.add(target)
        for target, p in params.items():
            module = self.get_submodule(target.rsplit(".", 1)[0])
            parts = len(getattr(module, "output_sizes", ())) if target in fused else 1
            if len(filled.get(target, ())) != parts:
                raise ValueError(f"parameter {target} was not loaded (or only in part)")
        for name, qw in (quantized or {}).items():
            target, shard = self._param_target(name)
            module = self.get_submodule(target.rsplit(".", 1)[0])
            module.set_quantized(qw, *(() if shard is None else (shard,)))
        embed = self.model.embed_tokens
        if self.config.tie_word_embeddings and embed.quantized is not None:
            self.lm_head.set_quantized(embed.quantized)  # its own copy is packed for products
        for target, p in self.named_parameters():
            if p.is_meta:
                m = self.get_submodule(target.rsplit(".", 1)[0])
                q = getattr(m, "quantized", None)
                if q is None or (isinstance(q, list) and None in q):
                    raise ValueError(f"parameter {target} has neither values nor a quantized "
                                     f"weight to make them from")

    def plan(self, num_tokens: int) -> StepPlan:
        """The step's :class:`StepPlan`: on the kernels, a step of at most ``quant_max_tokens``
        tokens runs the quantized weights (float32 activations; the whole-layer call where
        the model has it); a bfloat16 step above ``amx_max_tokens`` runs oneDNN with bfloat16
        activations between GEMMs (only Q/K/V go to float32); other steps float32."""
        dtype = self.lm_head.weight.dtype
        if self.kernels is None:
            return StepPlan(dtype, dtype)
        quant = num_tokens <= self.policy.quant_max_tokens
        act = (dtype if (not quant and dtype == torch.bfloat16
                         and num_tokens > self.policy.amx_max_tokens) else torch.float32)
        return StepPlan(act, torch.float32, quant and self.fused_layers)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_backend, attn_meta: Any,
                logits_indices: torch.Tensor, num_layers: int | None = None,
                layer_hooks=None) -> torch.Tensor:
        """One step over a flattened batch.

        Args:
            input_ids: [T] int64 token ids.
            positions: [T] int64 position of each token in its request.
            kv_caches: one tensor per layer, in ``attn_backend``'s layout.
            attn_backend: computes attention (and owns the cache layout).
            attn_meta: ``attn_backend.build_metadata(...)`` of this step.
            logits_indices: [S] int64 rows of T whose next-token logits are needed.
            num_layers: run only the first this many decoder layers, then the final norm and
                the LM head (``layer_skip`` speculative drafts; None: all). They write their
                layers' KV as a full step does (the verify step then overwrites it).
            layer_hooks: a KV connector's worker half, told around each layer's attention
                (``LlamaModel.forward``); None: none.

        Returns:
            [S, vocab_size] float32 logits.
        """
        plan = self.plan(input_ids.shape[0])
        if num_layers is not None and plan.fused:  # a whole-layer call makes the next layer's Q/K/V
            plan = dataclasses.replace(plan, fused=False)
        x = self.model(input_ids, positions, kv_caches, attn_backend, attn_meta,
                       logits_indices, plan, num_layers, layer_hooks)
        return self.lm_head(x, torch.float32).float()
