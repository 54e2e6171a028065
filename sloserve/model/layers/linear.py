"""Linear layers whose weight-format method is chosen at load, and the token-count policy that
picks, per call, between a layer's quantized and dense method.

A layer holds its dense weight (``weight`` [out, in] in the engine's dtype; a fused QKV or
gate/up layer holds its parts' rows one after another) and, where the checkpoint is served
quantized, its parts' :class:`~sloserve.model.quant.QuantizedWeight`. Its methods:

* :class:`UnquantizedLinearMethod`: the torch reference, ``F.linear`` in the engine's dtype.
* :class:`KernelDenseLinearMethod`: the dense weight on the project's kernels: the AMX bf16
  GEMM (``Kernels.amx_linear``, float32 activations rounded to bf16 in the kernel, no row
  padding) for calls of up to ``amx_max_tokens`` rows where the CPU has AMX, else torch's
  matmul (oneDNN) at :func:`dense_rows`' bucketed row counts.
* :class:`~sloserve.model.layers.quantization.GGUFLinearMethod`: the quantized blocks on the
  kernels, for calls of up to ``quant_max_tokens`` rows (memory-bound steps: decodes).

The two crossovers (:class:`LinearPolicy`, measured at start-up by
``sloserve.model.crossover``) are shared by every layer of a model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LinearPolicy:
    """Which method serves a call of ``rows`` rows: the quantized one up to ``quant_max_tokens``
    (0: never), then the AMX GEMM up to ``amx_max_tokens`` (0: never), then oneDNN."""

    quant_max_tokens: int = 0
    amx_max_tokens: int = 0


def dense_rows(tokens: int) -> int:
    """The row count a 16-bit dense GEMM of ``tokens`` rows runs at: the next power of two up to
    32, then the next multiple of 32 up to 256, then of 64: 17 shapes for a 512-token step
    budget, 41 for 2,048 (padding adds less than 1/4 of the rows above 256, half at most below)."""
    if tokens <= 32:
        return 1 << max(tokens - 1, 0).bit_length()
    step = 32 if tokens <= 256 else 64
    return -(-tokens // step) * step


def onednn_linear(x: torch.Tensor, w: torch.Tensor,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x`` [T, in] (float32 or ``w``'s dtype) times ``w`` [out, in] on torch's matmul (oneDNN
    in 16-bit dtypes), in ``w``'s dtype; [T, out] in ``out_dtype``.

    In a 16-bit dtype the rows are padded to :func:`dense_rows` (zeros; the product's first T
    rows are the result): oneDNN keeps one primitive, ~100 KB, per GEMM shape it has run, so
    every new step token count would cost memory for the server's lifetime. Padding is nearly
    free there: oneDNN's bf16/AMX kernels work in blocks of 16-64 rows anyway. Weights
    prepacked in oneDNN's blocked layout are not used: in serving the row count varies per step
    and a packed weight is reordered again for every other count."""
    T = x.shape[0]
    if w.is_meta:
        raise RuntimeError(f"a dense product of {T} rows on a weight kept only quantized: the "
                           f"model was loaded for steps the quantized weights serve")
    dtype = w.dtype
    rows = dense_rows(T) if dtype != torch.float32 else T
    if rows == T:
        xd = x.to(dtype)
    else:
        xd = x.new_zeros((rows, x.shape[1]), dtype=dtype)
        xd[:T] = x
    return F.linear(xd, w)[:T].to(out_dtype)


@dataclass(frozen=True)
class ReleasedWeight:
    """A quantized part whose values now live only in its layer's quantized method."""

    shape: tuple[int, int]
    source: str

    def dequantize(self):
        raise RuntimeError(f"the {self.source} weight {self.shape} was released after packing: "
                           f"its dense values cannot be made now")


class UnquantizedLinearMethod:
    """The torch reference: ``F.linear(x, weight, bias)`` in the engine's dtype (the output
    dtype asked for is the kernels' business; the reference stays in its input's dtype)."""

    def apply(self, layer: "LinearBase", x: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def swiglu(self, layer: "LinearBase", x: torch.Tensor, act_fn,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return act_fn(F.linear(x, layer.weight, layer.bias))


class KernelDenseLinearMethod:
    """The dense weight on the kernels: AMX up to ``policy.amx_max_tokens`` rows where ``amx``
    (the weight packed by ``Kernels.pack_amx``; for a gate/up layer ``amx_swiglu``, packed by
    ``pack_amx_swiglu`` for the fused SiLU-and-mul epilogue) is given, else
    :func:`onednn_linear`. The bias (float32) is added to the float32 output."""

    def __init__(self, kernels, policy: LinearPolicy, amx=None, amx_swiglu=None):
        self.k, self.policy, self.amx, self.amx_swiglu = kernels, policy, amx, amx_swiglu

    def apply(self, layer: "LinearBase", x: torch.Tensor,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.amx is not None and x.shape[0] <= self.policy.amx_max_tokens:
            y = self.k.amx_linear(x.float().contiguous(), self.amx)
            if out_dtype != torch.float32:
                y = y.to(out_dtype)
        else:
            y = onednn_linear(x, layer.weight, out_dtype)
        if layer.bias_f32 is not None:
            y += layer.bias_f32
        return y

    def swiglu(self, layer: "LinearBase", x: torch.Tensor, act_fn,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T): fused into the AMX GEMM's epilogue up to
        ``amx_max_tokens`` rows (float32), else oneDNN's product in ``out_dtype`` then
        ``act_fn``."""
        if self.amx_swiglu is not None and x.shape[0] <= self.policy.amx_max_tokens:
            return self.k.amx_swiglu(x.float().contiguous(), self.amx_swiglu)
        return act_fn(onednn_linear(x, layer.weight, out_dtype))


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W the rows of ``output_sizes`` parts one after another.

    ``forward(x, out_dtype)``: on the quantized method when there is one and ``x`` has at most
    ``policy.quant_max_tokens`` rows, else on the dense method (``method``). ``out_dtype`` is
    what the kernels hand on (float32, or bfloat16 between oneDNN GEMMs); the torch reference
    keeps its input's dtype.

    Loading: :meth:`weight_loader` copies a part's dense weight (or bias) into its rows;
    :meth:`set_quantized` records a part's quantized weight.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(out))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        #: each part's QuantizedWeight where the checkpoint is served quantized
        self.quantized: list = [None] * len(self.output_sizes)
        self.policy = LinearPolicy()
        self.method = UnquantizedLinearMethod()
        self.quant_method = None
        self.bias_f32: torch.Tensor | None = None  # the kernels' copy

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy one part (``shard_id``) of a fused weight, or the whole weight, into ``param``.

        Raises:
            ValueError: a shape that does not fit the part.
        """
        start = sum(self.output_sizes[:shard_id])
        n = self.output_sizes[shard_id]
        want = (n, *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"part {shard_id} of a {tuple(param.shape)} parameter: got "
                             f"{tuple(loaded.shape)}, expected {want}")
        with torch.no_grad():
            param.data[start:start + n].copy_(loaded)

    def set_quantized(self, qweight, shard_id: int = 0) -> None:
        self.quantized[shard_id] = qweight

    @property
    def is_quantized(self) -> bool:
        return all(q is not None for q in self.quantized)

    def release_quantized(self) -> None:
        """Let go of the parts' QuantizedWeights once ``quant_method`` holds the weights as the
        kernels take them (packed copies) and the dense weight is made or never will be: each
        part becomes a :class:`ReleasedWeight` (the model would otherwise hold a quantized
        model's weights twice)."""
        self.quantized = [q if q is None or isinstance(q, ReleasedWeight)
                          else ReleasedWeight(tuple(q.shape), q.source) for q in self.quantized]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.quant_method is not None and x.shape[0] <= self.policy.quant_max_tokens:
            return self.quant_method.apply(self, x)
        return self.method.apply(self, x, out_dtype)

    #: called without nn.Module's hook machinery (none is used): a step calls it per layer
    __call__ = forward


class ReplicatedLinear(LinearBase):
    """One weight [output_size, input_size] (o_proj, down_proj, the LM head)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, [output_size], bias)


class QKVLinear(LinearBase):
    """The fused Q, K and V projections: rows [q heads | k heads | v heads]; parts "q", "k",
    "v" (``weight_loader(param, w, "k")``)."""

    SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias)

    def weight_loader(self, param, loaded, shard_id="q") -> None:
        super().weight_loader(param, loaded, self.SHARDS[shard_id])

    def set_quantized(self, qweight, shard_id="q") -> None:
        super().set_quantized(qweight, self.SHARDS[shard_id])


class MergedColumnLinear(LinearBase):
    """Projections of the same input stacked by rows (gate and up: parts 0 and 1), with
    :meth:`swiglu` for silu(gate) * up."""

    def swiglu(self, x: torch.Tensor, act_fn, out_dtype: torch.dtype | None = None):
        """silu(x W_gate^T) * (x W_up^T) [T, F]: fused into the product where the method can
        (the quantized x16 product's and the AMX GEMM's epilogues), else the product then
        ``act_fn`` (a :class:`~sloserve.model.layers.activation.SiluAndMul`)."""
        if self.quant_method is not None and x.shape[0] <= self.policy.quant_max_tokens:
            return self.quant_method.swiglu(self, x, act_fn)
        return self.method.swiglu(self, x, act_fn, out_dtype)
