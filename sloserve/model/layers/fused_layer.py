"""The optional whole-layer kernel call: after a layer's attention, ``Kernels.run_x16_layer``
runs its output projection, add + RMSNorm, the fused gate/up SwiGLU product, the down
projection and (but for the last layer) the next layer's add + RMSNorm, Q/K/V product (+ bias)
and RoPE in one parallel region: the same numbers as the separate kernels, ~8 fewer calls per
layer. A model uses it for a quantized step when every layer's weights qualify."""
from __future__ import annotations

from sloserve.kernels import X16Weight


def _x16(linear, swiglu: bool = False):
    """The layer's one x16 weight (packed for the SwiGLU epilogue when ``swiglu``), or None."""
    m = linear.quant_method
    if m is None or len(m.weights) != 1 or not isinstance(m.weights[0], X16Weight):
        return None
    w = m.weights[0]
    return w if w.swiglu == swiglu else None


def build_fused_layers(kernels, layers, eps: float, heads: tuple[int, int, int]) -> list | None:
    """One ``X16Layer`` per decoder layer (``Kernels.x16_layer``, its weights checked once,
    here), or None when a weight does not qualify: Q/K/V one x16 weight, gate/up one weight
    packed for the SwiGLU epilogue, o and down x16."""
    parts = []
    for L in layers:
        a, m = L.self_attn, L.mlp
        p = (_x16(a.qkv_proj), _x16(a.o_proj), _x16(m.gate_up_proj, swiglu=True),
             _x16(m.down_proj))
        if any(w is None for w in p):
            return None
        parts.append(p)
    out = []
    for i, (L, (_, wo, gu, down)) in enumerate(zip(layers, parts)):
        nxt = None
        if i + 1 < len(layers):
            n = layers[i + 1]
            nxt = (n.input_layernorm.weight_f32, parts[i + 1][0], n.self_attn.qkv_proj.bias_f32)
        out.append(kernels.x16_layer(wo, L.post_attention_layernorm.weight_f32, gu, down, eps,
                                     nxt, heads))
    return out
