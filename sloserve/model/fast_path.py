"""The fused forward pass: a few kernel calls per layer, float32 activations, and per step the
linear-layer kernel that is fast for its number of tokens.

Per layer: [add residual +] RMSNorm (one call), the Q, K and V projections, RoPE on Q and K in
place, the attention backend, the output projection, add residual + RMSNorm, gate and up,
SiLU(gate) * up (in the epilogue of the quantized int8 product and of the AMX GEMM), the down
projection. No Python work per layer grows with the batch. Where every quantized weight is in
the kernels' x16 layout (the embedded model with int8 activations), a quantized step makes two
kernel calls per layer: the attention backend's, then ``Kernels.run_x16_layer`` from the output
projection to the next layer's RoPE'd Q/K/V in one parallel region (bit-identical; a 1-decode
step 4.2-4.4 -> 3.7-3.8 ms, 16 decodes 1-2 % faster, measured alternated in one process).

The projections of a step run one of three ways:

* ``quant``: the weights as they are stored (4-bit / int8 with per-group scales; the embedded
  SmolLM2: ~100 MB for its Q4_1 layers and the Q8_0 embedding that is also the LM head, against
  270 MB in bf16), through the project's kernels; Q/K/V and gate/up are one product each (rows
  concatenated). Memory-bound: the best for steps of few tokens (decodes).
* ``dense``: the dequantized weights in the engine's dtype on torch's GEMM (oneDNN/AMX in bf16
  where the CPU has it). Compute-bound steps (prefills, large batches).

* ``amx``: where the CPU has AMX (and the engine runs in bfloat16), the dense bf16 weights
  prepacked for this project's AMX GEMM (``Kernels.amx_linear``), float32 activations rounded to
  bf16 in the kernel: no padding of the rows, 1.3-2.5x torch's oneDNN matmul at 16-64 rows on
  the embedded model's shapes (measured), 0.7-1.0x of it alone at 256-512, where oneDNN in a
  step also pays its row padding and copies; it serves the steps between the quantized ones
  and ``amx_max_tokens`` (384-512 tokens on the AMX host measured). 270 MB more weights.

``quant_max_tokens`` (measured at start-up by :func:`quant_crossover`: the most tokens at which the
quantized product of a layer's MLP weight still beats the dense one on this CPU) separates them,
and ``amx_max_tokens`` (:func:`amx_crossover`, the same race of the AMX GEMM against oneDNN's)
the AMX steps from the oneDNN ones. The LM head follows the same rules for the rows that sample.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sloserve.model import hugepages
from sloserve.model.quant import QuantizedWeight, concat_rows
from sloserve.kernels import AmxWeight, X16Layer, X16Weight


@dataclass
class FastLayer:
    """One decoder layer's weights: norms and biases float32, the projections dense (engine
    dtype, [out, in]) and, when served quantized, quantized too."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv_bias: torch.Tensor | None
    dense: dict[str, torch.Tensor]               # qkv (fused), o, gate_up (fused), down
    qkv: list[QuantizedWeight | X16Weight] | None = None  # one fused weight, or q, k, v
    o: QuantizedWeight | X16Weight | None = None
    gate_up: list[QuantizedWeight | X16Weight] | None = None
    down: QuantizedWeight | X16Weight | None = None
    amx: dict[str, AmxWeight] | None = None      # the dense weights packed for the AMX GEMM
    tail: X16Layer | None = None  # this layer + the next one's input part, for x16_layer_tail


class FastPath:
    """Built from a model's parameters (HF names), its quantized weights (possibly none) and
    the loaded kernels.

    Args:
        config: the model's ModelConfig.
        params: HF name -> parameter (the model's, in the engine's dtype).
        quantized: HF name -> QuantizedWeight of every linear weight and the embedding (and
            ``lm_head.weight`` when untied), or {} for a dense model.
        kernels: ``sloserve.kernels.load()``'s result.
        inv_freq: RoPE inverse frequencies [head_dim / 2] float32.
        quant_max_tokens: steps with at most this many query tokens use the quantized weights
            (None: measure, :func:`quant_crossover`; ignored without quantized weights).
        int8_activations: the quantized products quantize their input to int8 per group of 32
            and use integer dot products (VNNI / pmaddubsw: ~1.4x faster, activations rounded to
            ~1/254 of their group's largest value, as llama.cpp does); False: float32 inputs,
            the weights' exact values times exact activations (``--dtype float32``).
        amx_max_tokens: dense steps with at most this many tokens use the AMX GEMM (None:
            measure, :func:`amx_crossover`; 0 without AMX or outside bfloat16).
    """

    def __init__(self, config, params: dict[str, torch.Tensor],
                 quantized: dict[str, QuantizedWeight], kernels, inv_freq: torch.Tensor,
                 quant_max_tokens: int | None = None, int8_activations: bool = True,
                 amx_max_tokens: int | None = None):
        self.config, self.k = config, kernels
        self.int8_activations = int8_activations
        self.inv_freq = inv_freq.float().contiguous()
        self.eps = float(config.rms_norm_eps)
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.embed_dense = params["model.embed_tokens.weight"].detach()
        self.lm_dense = (self.embed_dense if config.tie_word_embeddings
                         else params["lm_head.weight"].detach())
        self.dtype = self.embed_dense.dtype
        q = quantized
        self.quantized = bool(q)
        self.embed_q = q.get("model.embed_tokens.weight")
        self.lm_q = q.get("lm_head.weight", self.embed_q if config.tie_word_embeddings else None)
        if self.lm_q is not None and int8_activations:
            self.lm_q = self._pack(self.lm_q)  # its own copy when tied: qembed reads rows
        self.norm = f32(params["model.norm.weight"])
        self.layers: list[FastLayer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                     "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                     "down": "mlp.down_proj"}
            dense = {k: params[f"{p}{v}.weight"].detach() for k, v in names.items()}
            # fused copies for the dense path: one GEMM each instead of 3 / 2 and a concat
            dense["qkv"] = torch.cat([dense["q"], dense["k"], dense["v"]]).contiguous()
            dense["gate_up"] = torch.cat([dense["gate"], dense["up"]]).contiguous()
            for n in ("q", "k", "v", "gate", "up"):
                del dense[n]
            bias = None
            if config.attention_bias:
                bias = torch.cat([f32(params[f"{p}self_attn.{n}_proj.bias"]) for n in "qkv"])
            L = FastLayer(f32(params[p + "input_layernorm.weight"]),
                          f32(params[p + "post_attention_layernorm.weight"]), bias, dense)
            if q:
                qw = [q[f"{p}{names[n]}.weight"] for n in ("q", "k", "v")]
                fused = concat_rows(qw)
                L.qkv = [fused] if fused else qw
                L.o = q[f"{p}{names['o']}.weight"]
                gu = [q[f"{p}{names[n]}.weight"] for n in ("gate", "up")]
                fused = concat_rows(gu)
                L.gate_up = [fused] if fused else gu
                L.down = q[f"{p}{names['down']}.weight"]
                if int8_activations:
                    L.qkv = [self._pack(w) for w in L.qkv]
                    # one fused gate/up weight: SiLU(gate) * up in the product's epilogue
                    L.gate_up = ([kernels.pack_x16_swiglu(L.gate_up[0]) or self._pack(L.gate_up[0])]
                                 if len(L.gate_up) == 1 else [self._pack(w) for w in L.gate_up])
                    L.o, L.down = self._pack(L.o), self._pack(L.down)
            self.layers.append(L)
        self._onto_hugepages()
        use_amx = kernels.amx and self.dtype == torch.bfloat16 and amx_max_tokens != 0
        self.lm_amx = kernels.pack_amx(self.lm_dense) if use_amx else None
        if use_amx:
            for L in self.layers:
                packed = {n: (kernels.pack_amx_swiglu(w) if n == "gate_up" else kernels.pack_amx(w))
                          for n, w in L.dense.items()}
                if all(packed.values()):
                    L.amx = packed
            use_amx = self.lm_amx is not None and all(L.amx for L in self.layers)
        # dense weight -> its AMX copy, by identity (what _d is handed is the dense tensor);
        # gate_up's copy is interleaved for the fused SwiGLU (_swiglu), never a plain product
        self._amx = ({id(L.dense[n]): a for L in self.layers for n, a in L.amx.items()
                      if n != "gate_up"} | {id(self.lm_dense): self.lm_amx}) if use_amx else {}
        #: every layer's quantized weights are x16 (Q/K/V one weight, gate/up packed for the
        #: SwiGLU epilogue): a quantized step runs each layer after its attention as one
        #: ``Kernels.run_x16_layer`` call (same numbers, ~8 fewer calls per layer)
        self.fused_layers = bool(q) and all(
            len(L.qkv) == 1 and isinstance(L.qkv[0], X16Weight) and not L.qkv[0].swiglu
            and isinstance(L.o, X16Weight) and isinstance(L.down, X16Weight)
            and len(L.gate_up) == 1 and getattr(L.gate_up[0], "swiglu", False)
            for L in self.layers)
        if self.fused_layers:  # each layer's call checked once, here
            heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
            for L, n in zip(self.layers, [*self.layers[1:], None]):
                L.tail = kernels.x16_layer(L.o, L.ln2, L.gate_up[0], L.down, self.eps,
                                           (n.ln1, n.qkv[0], n.qkv_bias) if n else None, heads)
        # each crossover: 0 without its path, else as given, else measured (AMX's first: the
        # quantized one races the dense path that will serve those steps)
        self.amx_max_tokens = _given_or(amx_max_tokens, use_amx, lambda: amx_crossover(self))
        self.quant_max_tokens = _given_or(quant_max_tokens, bool(q), lambda: quant_crossover(self))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a quantized step reads (layers + LM head)."""
        if not self.quantized:
            return 0
        n = self.lm_q.nbytes if self.lm_q is not None else 0
        for L in self.layers:
            n += sum(w.nbytes for w in (*L.qkv, L.o, *L.gate_up, L.down))
        return n

    def _onto_hugepages(self) -> None:
        """Every x16 weight (layers and LM head) copied into one buffer on 2 MB pages (see
        :mod:`sloserve.model.hugepages`: a decode step streams all of them)."""
        ws = [w for L in self.layers for w in (*(L.qkv or ()), L.o, *(L.gate_up or ()), L.down)
              if isinstance(w, X16Weight)]
        if isinstance(self.lm_q, X16Weight):
            ws.append(self.lm_q)
        if not ws:
            return
        parts = [[t for t in (w.qweight, w.scales, w.mins) if t is not None] for w in ws]
        moved = iter(hugepages.pack([t for p in parts for t in p]))
        new = {}
        for w, p in zip(ws, parts):
            qw, d = next(moved), next(moved)
            mn = next(moved) if w.mins is not None else None
            new[id(w)] = dataclasses.replace(w, qweight=qw, scales=d, mins=mn)
        get = lambda w: new.get(id(w), w)  # noqa: E731
        for L in self.layers:
            if L.qkv is not None:
                L.qkv, L.gate_up = [get(w) for w in L.qkv], [get(w) for w in L.gate_up]
                L.o, L.down = get(L.o), get(L.down)
        self.lm_q = get(self.lm_q)

    # ------------------------------------------------------------------ projections
    def _pack(self, w: QuantizedWeight):
        """4- and 8-bit group-32 weights go to the kernels' x16 layout (16 rows per integer dot
        product; 1.5-3.5x faster than the row layout at 1-5 tokens, measured); others stay."""
        return self.k.pack_x16(w) or w

    def _lin(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T on the quantized weight ``w`` (for a gate/up weight packed for the fused
        SwiGLU: silu(gate) * up, [T, intermediate])."""
        if isinstance(w, X16Weight):
            return self.k.qlinear_x16_swiglu(x, w) if w.swiglu else self.k.qlinear_x16(x, w)
        if self.int8_activations and w.group_size == 32:
            return self.k.qlinear_i8(x, w)
        return self.k.qlinear(x, w)

    def _swiglu_q(self, x: torch.Tensor, L: FastLayer) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) of a quantized step, [T, intermediate] float32: one
        fused product where gate/up is packed for it, else the product then silu_mul."""
        gu = L.gate_up
        if len(gu) == 1 and getattr(gu[0], "swiglu", False):
            return self._lin(x, gu[0])
        return self.k.silu_mul(self._q(x, gu))

    def _q(self, x: torch.Tensor, ws: list[QuantizedWeight]) -> torch.Tensor:
        if len(ws) == 1:
            return self._lin(x, ws[0])
        return torch.cat([self._lin(x, w) for w in ws], dim=1)

    def _d(self, x: torch.Tensor, w: torch.Tensor,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``x`` [T, in] (float32 or the engine's dtype) times the dense weight ``w`` [out, in],
        in the engine's dtype; [T, out] in ``out_dtype`` (float32, or the engine's dtype as the
        GEMM gives it): on the AMX GEMM up to ``amx_max_tokens`` rows, else :meth:`_onednn`."""
        if self._amx and x.shape[0] <= self.amx_max_tokens:
            y = self.k.amx_linear(x.float().contiguous(), self._amx[id(w)])
            return y if out_dtype == torch.float32 else y.to(out_dtype)
        return self._onednn(x, w, out_dtype)

    def _swiglu(self, x: torch.Tensor, L: FastLayer, act: torch.dtype) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) of a dense step, x [T, hidden] -> [T, intermediate] in
        ``act``: fused into the AMX GEMM's epilogue up to ``amx_max_tokens`` rows (float32),
        else oneDNN's product then :meth:`Kernels.silu_mul`."""
        if self._amx and x.shape[0] <= self.amx_max_tokens:
            return self.k.amx_swiglu(x.float().contiguous(), L.amx["gate_up"])
        return self._onednn_swiglu(x, L, act)

    def _onednn_swiglu(self, x: torch.Tensor, L: FastLayer, act: torch.dtype) -> torch.Tensor:
        """:meth:`_swiglu` on oneDNN: the gate/up product, then :meth:`Kernels.silu_mul`."""
        return self.k.silu_mul(self._onednn(x, L.dense["gate_up"], out_dtype=act))

    def _onednn(self, x: torch.Tensor, w: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`_d` on torch's matmul (oneDNN in 16-bit dtypes).

        In a 16-bit dtype the rows are padded to :func:`dense_rows` (zeros; the product's first
        T rows are the result): oneDNN keeps one primitive, ~100 KB, per GEMM shape it has run,
        so every new step token count cost memory (RSS grew ~0.5 MiB per new count, +11 % over a
        5-minute overload soak). Padding is nearly free there: oneDNN's bf16/AMX kernels work in
        blocks of 16-64 rows anyway. (Weights prepacked in oneDNN's blocked layout were tried:
        faster for a fixed row count, slower in serving, where the row count varies per step
        and a packed weight is reordered again for every other count.)"""
        T = x.shape[0]
        rows = dense_rows(T) if self.dtype != torch.float32 else T
        if rows == T:
            xd = x.to(self.dtype)
        else:
            xd = x.new_zeros((rows, x.shape[1]), dtype=self.dtype)
            xd[:T] = x
        return F.linear(xd, w)[:T].to(out_dtype)

    def warm_up(self, max_tokens: int, max_sampled: int) -> int:
        """Run each dense GEMM shape a step of up to ``max_tokens`` tokens (``max_sampled``
        sampled rows for the LM head) can take once, on zeros, so that no request pays for
        creating it: oneDNN builds (JIT-compiles) a primitive the first time it sees a shape,
        ~13-17 ms for a layer's four weights at one row count, measured here, which a server
        otherwise adds to the first step of every new :func:`dense_rows` bucket (vLLM warms its
        compile sizes at start-up for the same reason). Only for 16-bit dtypes (float32 steps
        are not padded to buckets). Returns the number of shapes run."""
        if self.dtype == torch.float32:
            return 0
        layer_weights = {tuple(w.shape): w for w in self.layers[0].dense.values()}.values()
        # quant_max_tokens is 0 without quantized weights: every step is dense then
        # and steps up to amx_max_tokens run the AMX GEMM, which has no per-shape state
        first = max(self.quant_max_tokens, self.amx_max_tokens) + 1
        plan = ((first, max_tokens, layer_weights),
                (first if self.lm_q is not None else self.amx_max_tokens + 1, max_sampled,
                 [self.lm_dense]))
        runs = 0
        for first, last, weights in plan:
            for rows in sorted({dense_rows(t) for t in range(first, last + 1)}):
                for w in weights:
                    F.linear(torch.zeros(rows, w.shape[1], dtype=self.dtype), w)
                    runs += 1
        return runs

    # ------------------------------------------------------------------ the step
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_backend, attn_meta: Any,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward``; returns [S, vocab] float32 logits."""
        k, c = self.k, self.config
        T = input_ids.shape[0]
        H, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        quant = T <= self.quant_max_tokens
        # a dense bfloat16 step hands its GEMMs bf16 from the norm kernels and keeps their bf16
        # outputs for SwiGLU and the residual add; only Q/K/V go to float32 (RoPE, attention)
        # (the AMX GEMM takes float32 and rounds it itself)
        act = (self.dtype if (not quant and self.dtype == torch.bfloat16
                              and T > self.amx_max_tokens) else torch.float32)
        if self.embed_q is not None:
            h = k.qembed(input_ids, self.embed_q)    # the residual stream, float32 [T, d]
        else:
            h = self.embed_dense.index_select(0, input_ids).float()
        delta = qkv = None
        cos, sin = k.rope_tables(positions, self.inv_freq)  # once for all layers
        # a quantized step with every weight in the x16 layout: after its attention each layer
        # is one kernel call that also runs the next layer up to its attention
        fused = quant and self.fused_layers
        if fused:
            bufs = (torch.empty(T, c.hidden_size), torch.empty(T, c.hidden_size),
                    torch.empty(T, c.intermediate_size))
        for L, cache in zip(self.layers, kv_caches):
            w = L.dense
            roped = qkv is not None  # the previous layer's fused call made it, RoPE applied
            if not roped:
                a = k.rms_norm(h, L.ln1, self.eps, act) if delta is None else \
                    k.add_rms_norm(h, delta, L.ln1, self.eps, act)
                qkv = self._q(a, L.qkv) if quant else self._d(a, w["qkv"])
                if L.qkv_bias is not None:
                    qkv += L.qkv_bias
            q = qkv[:, :H * D].view(T, H, D)
            kk = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
            v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
            if not roped:
                k.rope(q, kk, cos, sin)
            o = attn_backend.forward(q, kk, v, cache, attn_meta, D ** -0.5)
            o = o.reshape(T, H * D).float().contiguous()
            qkv = None
            if fused:
                out = k.run_x16_layer(L.tail, o, h, bufs, cos, sin)
                qkv, delta = (out, None) if L.tail.nxt else (None, out)
                continue
            delta = self._lin(o, L.o) if quant else self._d(o, w["o"], out_dtype=act)
            a = k.add_rms_norm(h, delta, L.ln2, self.eps, act)
            f = self._swiglu_q(a, L) if quant else self._swiglu(a, L, act)
            delta = self._lin(f, L.down) if quant else self._d(f, w["down"], out_dtype=act)
        h += delta
        x = k.rms_norm(h.index_select(0, logits_indices), self.norm, self.eps)
        if self.lm_q is not None and x.shape[0] <= self.quant_max_tokens:
            return self._lin(x, self.lm_q)
        return self._d(x, self.lm_dense)


def _given_or(given: int | None, available: bool, measure) -> int:
    return 0 if not available else measure() if given is None else given


def dense_rows(tokens: int) -> int:
    """The row count a 16-bit dense GEMM of ``tokens`` rows runs at: the next power of two up to
    32, then the next multiple of 32 up to 256, then of 64: 17 shapes for a 512-token step
    budget, 41 for 2,048 (padding adds less than 1/4 of the rows above 256, half at most below)."""
    if tokens <= 32:
        return 1 << max(tokens - 1, 0).bit_length()
    step = 32 if tokens <= 256 else 64
    return -(-tokens // step) * step


def quant_crossover(fp: FastPath, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192,
                                        256, 384, 512, 768, 1024, 1536, 2048),
                    repeats: int = 7) -> int:
    """The most tokens at which the quantized product of layer 0's gate/up and down weights is
    still faster than the dense one here (~50 ms at start-up where the dense GEMM wins above 32
    tokens, ~1 s where the quantized one wins up to 2,048). The sizes go past a decode batch: on
    an AVX512-VNNI CPU without AMX (Zen 5) the int8 product ran at 1.2-1.3 TOP/s against
    oneDNN's bf16 0.8 at 64-512 rows (measured), so prefill chunks are faster on it too."""
    L = fp.layers[0]

    def quant(x, xf):
        fp._swiglu_q(x, L)
        fp._lin(xf, L.down)

    def dense(x, xf):
        fp._swiglu(x, L, torch.float32)
        fp._d(xf, L.dense["down"])
    return _crossover(fp, sizes, quant, dense, repeats)


def amx_crossover(fp: FastPath, sizes=(32, 64, 96, 128, 192, 256, 320, 384, 512, 768, 1024,
                                      1536, 2048), repeats: int = 7) -> int:
    """The most tokens at which the AMX GEMM of layer 0's gate/up and down weights is still
    faster than torch's matmul (oneDNN, rows padded as :meth:`FastPath._onednn` pads them) here
    (~0.5-1 s at start-up). Sizes below the first are AMX's when it wins there (it does by
    1.3-2.5x at 16-64 rows, measured). The sizes go past the default 512-token step: with the
    race stopping at 512, a step of 1 decode + a 512-token chunk ran on oneDNN in 179-181 ms
    against 154-157 ms on the AMX GEMM (measured, alternated)."""
    L = fp.layers[0]

    def amx(x, xf):
        fp.k.amx_swiglu(x, L.amx["gate_up"])
        fp.k.amx_linear(xf, L.amx["down"])

    def dense(x, xf):
        fp._onednn_swiglu(x, L, fp.dtype)
        fp._onednn(xf, L.dense["down"])
    return _crossover(fp, sizes, amx, dense, repeats)


def _crossover(fp: FastPath, sizes, first, second, repeats: int) -> int:
    """The largest of ``sizes`` (rows) at which ``first(x, xf)`` (x [rows, hidden], xf [rows,
    intermediate]) runs faster than ``second``, their runs alternated (best of ``repeats``
    each, so that a burst of load on these shared machines hits both); 0 if none. Stops after
    two sizes in a row that ``first`` loses."""
    best_m, losses = 0, 0
    for m in sizes:
        x = torch.randn(m, fp.config.hidden_size)
        xf = torch.randn(m, fp.config.intermediate_size)
        first(x, xf)
        second(x, xf)
        ta = tb = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            first(x, xf)
            t1 = time.perf_counter()
            second(x, xf)
            ta, tb = min(ta, t1 - t0), min(tb, time.perf_counter() - t1)
        if ta < tb:
            best_m, losses = m, 0
        else:
            losses += 1
            if losses == 2:
                break
    return best_m
