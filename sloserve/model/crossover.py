"""The token-count crossovers of a model's linear layers (:class:`~sloserve.model.layers.linear.
LinearPolicy`), measured at start-up on this CPU by racing layer 0's MLP weights."""
from __future__ import annotations

import time

import torch

from sloserve.model.layers.linear import onednn_linear


def quant_crossover(model, sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192,
                                  256, 384, 512, 768, 1024, 1536, 2048),
                    repeats: int = 7) -> int:
    """The most tokens at which the quantized product of layer 0's gate/up and down weights is
    still faster than the dense one (as the dense method serves it, AMX included) here (~50 ms
    at start-up where the dense GEMM wins above 32 tokens, ~1 s where the quantized one wins up
    to 2,048). The sizes go past a decode batch: on an AVX512-VNNI CPU without AMX the int8
    product can beat oneDNN's bf16 GEMM at prefill sizes too."""
    mlp = model.model.layers[0].mlp
    gu, down, act = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn

    def quant(x, xf):
        gu.quant_method.swiglu(gu, x, act)
        down.quant_method.apply(down, xf)

    def dense(x, xf):
        gu.method.swiglu(gu, x, act, torch.float32)
        down.method.apply(down, xf, torch.float32)
    return _crossover(model.config, sizes, quant, dense, repeats)


def amx_crossover(model, sizes=(32, 64, 96, 128, 192, 256, 320, 384, 512, 768, 1024, 1536,
                                2048), repeats: int = 7) -> int:
    """The most tokens at which the AMX GEMM of layer 0's gate/up and down weights is still
    faster than torch's matmul (oneDNN, rows padded as :func:`onednn_linear` pads them) here
    (~0.5-1 s at start-up). Sizes below the first are AMX's when it wins there. The sizes go
    past the default 512-token step: a step of a decode and a 512-token chunk is one of the
    steps this decides."""
    mlp = model.model.layers[0].mlp
    gu, down, act = mlp.gate_up_proj, mlp.down_proj, mlp.act_fn
    k = gu.method.k
    dtype = gu.weight.dtype

    def amx(x, xf):
        k.amx_swiglu(x, gu.method.amx_swiglu)
        k.amx_linear(xf, down.method.amx)

    def dense(x, xf):
        act(onednn_linear(x, gu.weight, dtype))
        onednn_linear(xf, down.weight)
    return _crossover(model.config, sizes, amx, dense, repeats)


def _crossover(config, sizes, first, second, repeats: int) -> int:
    """The largest of ``sizes`` (rows) at which ``first(x, xf)`` (x [rows, hidden], xf [rows,
    intermediate]) runs faster than ``second``, their runs alternated (best of ``repeats``
    each, so that a burst of load on a shared machine hits both); 0 if none. Stops after two
    sizes in a row that ``first`` loses."""
    best_m, losses = 0, 0
    for m in sizes:
        x = torch.randn(m, config.hidden_size)
        xf = torch.randn(m, config.intermediate_size)
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
