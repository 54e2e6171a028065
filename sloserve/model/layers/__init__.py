"""The building blocks the models are written from, one job per file.

Each op has a torch reference (``forward_native``) and, where the project's CPU kernels serve
it, a kernel implementation (``forward_kernel``); :class:`~.custom_op.CustomOp` runs one of the
two, chosen once when the model is built (``sloserve.model.model_loader.get_model``). The
linear layers pick their weight format's method at load (:mod:`.linear`, :mod:`.quantization`)
and, per call, between the quantized and the dense one by their row count
(:class:`~.linear.LinearPolicy`).

- :mod:`.custom_op`: the native / kernel dispatch.
- :mod:`.linear`: linear, fused QKV and gate/up layers; the torch and dense-kernel methods
  (AMX bf16 GEMM, oneDNN at bucketed row counts); the token-count policy.
- :mod:`.quantization`: the quantized GGUF-block method (x16 layout, int8 or float32
  activations, the row-layout fallback).
- :mod:`.layernorm`, :mod:`.rotary_embedding`, :mod:`.activation`, :mod:`.attention`,
  :mod:`.vocab_embedding`: RMSNorm (+ fused add), RoPE, SiLU-and-mul, attention, the embedding
  and LM head.
- :mod:`.fused_layer`: the optional whole-layer kernel call (output projection to the next
  layer's RoPE'd QKV) a model uses when every weight of every layer qualifies.
"""
