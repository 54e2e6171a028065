"""Build the model the engine serves: load its weights, then choose each op's implementation.

:func:`get_model` is the one call the engine makes. Where the kernels load (and without
``--enforce-eager``) :func:`use_kernels` puts every op on them and gives each linear layer its
methods: the quantized weights (:class:`~sloserve.model.layers.quantization.GGUFLinearMethod`)
for steps of up to ``quant_max_tokens`` tokens, the dense ones (AMX up to ``amx_max_tokens``,
oneDNN above) for larger ones; both crossovers measured here at start-up
(:mod:`sloserve.model.crossover`). Everywhere else every op runs its torch reference.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from sloserve.kernels import X16Weight
from sloserve.model import crossover, hugepages
from sloserve.model.invariant import ALL_ROWS, RopeTableCache
from sloserve.model.layers.custom_op import CustomOp
from sloserve.model.layers.fused_layer import build_fused_layers
from sloserve.model.layers.linear import (KernelDenseLinearMethod, LinearBase,
                                          MergedColumnLinear, dense_rows)
from sloserve.model.layers.quantization import GGUFLinearMethod

logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """:func:`get_model`'s result.

    Attributes:
        model: the ``LlamaForCausalLM``, its ops chosen, ready to run.
        name: the served model name of the weights (GGUF: the file stem without its quant tag).
        weights_line: the one start-up log line saying which weights and kernels serve which
            steps.
    """

    model: torch.nn.Module
    name: str
    weights_line: str


def get_model(config, dtype: torch.dtype) -> LoadedModel:
    """Load ``config.model`` (an ``EngineConfig``: model, load_format, quantization,
    enforce_eager, dtype, max_num_batched_tokens, max_num_seqs) in ``dtype`` and choose its
    ops: the kernels where they load and ``--enforce-eager`` is off (int8 activations for the
    quantized products unless ``--dtype float32``), else the torch reference. On the kernels
    the dense GEMM shapes a step can take are run once (:func:`warm_up`). With
    ``batch_invariant`` one method serves every step (:func:`make_batch_invariant`).

    Raises:
        everything ``sloserve.model.loader.load_model`` raises; ValueError for
        ``batch_invariant`` where the kernels do not load or cannot serve the weights
        invariantly.
    """
    from sloserve.model.loader import load_model
    # a GGUF's quantized weights get their dense copy only where a step will use it (below)
    model, weights = load_model(config.model, dtype, config.load_format, with_tokenizer=False,
                                quantization=config.quantization, dense_quantized=False)
    q = weights.quantized
    dt = str(dtype).removeprefix("torch.")
    name = weights.name
    stored = (f"{weights.quantization} ("
              + ", ".join(f"{k} x {n}" for k, n in Counter(w.source for w in q.values()).items())
              + f"; {sum(w.nbytes for w in q.values()) / 1e6:.0f} MB)") if q else None
    del weights, q  # the model holds what it serves; the rest is freed before packing
    release_freed_memory()

    def head() -> str:
        dense_mb = model.dense_weight_bytes / 1e6
        if stored is None:
            return f"weights: dense {dt} ({dense_mb:.0f} MB)"
        dense = (f"dense {dt} ({dense_mb:.0f} MB)" if model.has_dense_copy else
                 f"no dense copy (no step uses one; {dense_mb:.1f} MB of norms and biases)")
        return f"weights: {stored} + {dense}"
    if config.enforce_eager:
        model.materialize_dense()
        return LoadedModel(model, name,
                           f"{head()}; --enforce-eager: every step on the model's torch forward")
    from sloserve import kernels
    k = kernels.load()
    inv = getattr(config, "batch_invariant", False)
    if k is None:
        if inv:
            raise ValueError("--batch-invariant runs on the CPU kernels, which do not load here")
        model.materialize_dense()
        return LoadedModel(model, name, f"{head()}; no CPU kernels here: every step on "
                                                f"the model's torch forward")
    # --dtype float32 asks for exact arithmetic: the quantized products then take float32
    # inputs; otherwise (auto, bf16) they quantize them to int8 like llama.cpp (~1.4x faster)
    int8_act = config.dtype != "float32"
    if inv:
        make_batch_invariant(model, k, int8_act)
        return LoadedModel(model, name, f"{head()}; fused forward on the {k.variant} "
                                                f"kernels, --batch-invariant: {model.invariant_how}")
    largest = largest_step(config, model)
    use_kernels(model, k, int8_activations=int8_act, max_tokens=largest,
                dense_budget=lambda: dense_budget(config))
    p = model.policy
    xo = ("measured" if crossover.last_source == "measured"
          else f"read from {crossover.last_source}")
    dense = f"dense {dt} GEMM"
    if p.amx_max_tokens:
        dense = (f"the AMX {dt} GEMM up to {p.amx_max_tokens} tokens (crossover with "
                 f"oneDNN measured), dense {dt} GEMM (oneDNN) above")
    if stored and p.quant_max_tokens >= largest:
        how = (f"every step (<= {largest} tokens) on the quantized "
               f"weights ({model.quantized_weight_bytes / 1e6:.0f} MB per step, "
               f"{'int8' if int8_act else 'float32'} activations; crossover {xo})")
    elif stored:
        how = (f"steps of <= {p.quant_max_tokens} tokens on the quantized weights "
               f"({model.quantized_weight_bytes / 1e6:.0f} MB per step, "
               f"{'int8' if int8_act else 'float32'} activations; crossover {xo}), larger "
               f"ones on {dense}")
    else:
        how = f"every step on {dense}"
    t0 = time.perf_counter()
    shapes = warm_up(model, config.max_num_batched_tokens,
                     min(config.max_num_seqs, config.max_num_batched_tokens))
    if shapes:
        how += f" ({shapes} GEMM shapes warmed in {time.perf_counter() - t0:.1f} s)"
    return LoadedModel(model, name, f"{head()}; fused forward on the {k.variant} "
                                            f"kernels, {how}")


def largest_step(config, model) -> int:
    """The most tokens one step of ``model`` can take under ``config``: the token budget;
    without chunked prefill a whole prompt (up to ``--max-model-len``, else the model's
    context: the scheduler's ``token_budget``); at least the verify-cost measurement's steps
    that speculative decoding runs at start-up (:data:`~sloserve.step_io.VERIFY_COST_TOKENS`)."""
    from sloserve.step_io import VERIFY_COST_TOKENS
    n = config.max_num_batched_tokens
    if config.batching != "chunked":
        n = max(n, config.max_model_len or model.config.max_position_embeddings)
    return max(n, *VERIFY_COST_TOKENS)


#: memory left free beside the weights, their dense copy and the KV cache (activations, the
#: API process, the page cache the weights' file is read through)
DENSE_MARGIN_BYTES = 2 * 2**30


def dense_budget(config) -> int | None:
    """The bytes a dense copy of the weights may take on this machine: its available memory
    (``MemAvailable``, the weights already loaded) less the KV cache ``config`` asks for
    (``kv_cache_memory``; ``num_kv_blocks`` is counted at start-up, not here) and
    :data:`DENSE_MARGIN_BYTES`. None where the kernel does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    kv = 0 if config.num_kv_blocks is not None else int(config.kv_cache_memory * 2**30)
    return avail - kv - DENSE_MARGIN_BYTES


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere).
    Loading makes and frees many temporaries of 1-30 MB, below glibc's mmap threshold once it
    has grown, and glibc keeps that memory: an 8B model otherwise stayed at 11 GB resident,
    5.8 GB after the trim."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def use_kernels(model, kernels, int8_activations: bool = True,
                quant_max_tokens: int | None = None, amx_max_tokens: int | None = None,
                max_tokens: int | None = None,
                dense_budget: Callable[[], int | None] | None = None) -> None:
    """Put every op of ``model`` on ``kernels`` and give each linear layer its methods.

    Args:
        model: a loaded ``LlamaForCausalLM`` (its linear layers' quantized weights, if any,
            handed to them by its ``load_weights``).
        kernels: ``sloserve.kernels.load()``'s result.
        int8_activations: the quantized products quantize their input to int8 per group of 32
            (see :mod:`sloserve.model.layers.quantization`); False: float32 inputs.
        quant_max_tokens: steps with at most this many tokens use the quantized weights (None:
            measure, :func:`~sloserve.model.crossover.quant_crossover`; 0 without quantized
            weights).
        amx_max_tokens: dense steps with at most this many tokens use the AMX GEMM (None:
            measure, :func:`~sloserve.model.crossover.amx_crossover`; 0 without AMX or outside
            bfloat16).
        max_tokens: the most tokens a step will have (:func:`largest_step`; None: no bound).
            Where the quantized weights serve every step up to it, the model keeps no dense
            copy of them (:meth:`~sloserve.model.llama.LlamaForCausalLM.materialize_dense`
            makes one only where a step will use it, and layer 0's MLP for the race).
        dense_budget: the bytes a dense copy for the steps above the crossover may take, asked
            when the copy would be made (the packed weights then held; None: no bound). A
            larger one is not made: the quantized weights serve every step up to
            ``max_tokens`` instead (slower prefill, but an 8B model's 16 GB bf16 copy beside
            its weights and KV cache would exhaust a 24 GiB machine), with a warning.
    """
    model.kernels = kernels
    for m in model.modules():
        if isinstance(m, CustomOp):
            m.use_kernels(kernels)
    linears = model.linear_layers()
    policy = model.policy
    dtype = model.lm_head.weight.dtype
    quantized = all(lin.is_quantized for lin in linears)
    for lin in linears:
        lin.policy = policy
        lin.bias_f32 = (lin.bias.detach().float().contiguous()
                        if lin.bias is not None else None)
        lin.quant_method = None

    def make_method(lin) -> None:
        lin.quant_method = GGUFLinearMethod.create(kernels, lin.quantized, int8_activations,
                                                   swiglu=_is_gate_up(model, lin))
    if quantized:  # packing lets go of the GIL: one layer per CPU at a time
        with ThreadPoolExecutor(max_workers=_loader_threads()) as ex:
            list(ex.map(make_method, linears))
        release_freed_memory()
    model.decode_weights = _onto_hugepages(linears)
    # the dense weights packed for the AMX GEMM: every one, or none
    use_amx = kernels.amx and dtype == torch.bfloat16 and amx_max_tokens != 0
    if use_amx or not quantized:
        model.materialize_dense()
    packs = {}
    if use_amx:
        for lin in linears:
            w = lin.weight.detach()
            packs[lin] = ((kernels.pack_amx_swiglu(w) if _is_gate_up(model, lin)
                           else kernels.pack_amx(w)))
        use_amx = all(a is not None for a in packs.values())
    for lin in linears:
        a = packs.get(lin) if use_amx else None
        swi = _is_gate_up(model, lin)
        lin.method = KernelDenseLinearMethod(kernels, policy, None if swi else a,
                                             a if swi else None)
    heads = (model.config.num_attention_heads, model.config.num_key_value_heads,
             model.config.head_dim)
    fused = build_fused_layers(kernels, model.model.layers, float(model.config.rms_norm_eps),
                               heads) if quantized else None
    for L, f in zip(model.model.layers, fused or [None] * len(model.model.layers)):
        L.fused = f
    #: every layer's quantized weights are x16 (Q/K/V one weight, gate/up packed for the
    #: SwiGLU epilogue): a quantized step runs each layer after its attention as one
    #: ``Kernels.run_x16_layer`` call
    model.fused_layers = fused is not None
    model.model.kernels = kernels
    # each crossover: 0 without its path, else as given, else measured (AMX's first: the
    # quantized one races the dense path that will serve those steps)
    policy.amx_max_tokens = _given_or(amx_max_tokens, use_amx,
                                      lambda: crossover.amx_crossover(model))
    mlp0 = [model.model.layers[0].mlp.gate_up_proj, model.model.layers[0].mlp.down_proj]
    raced = []  # layer 0's dense MLP, made for a race (not when the crossover is cached)
    policy.quant_max_tokens = _given_or(
        quant_max_tokens, quantized,
        lambda: crossover.quant_crossover(
            model, max_tokens=max_tokens,
            prepare=lambda: raced.append(model.materialize_dense(mlp0))))
    limit = ALL_ROWS if max_tokens is None else max_tokens
    if quantized and policy.quant_max_tokens < limit:
        need, budget = model.dense_copy_bytes(), dense_budget() if dense_budget else None
        if budget is not None and need > budget:
            logger.warning("the dense %s copy of the weights for steps above %d tokens would "
                           "take %.1f GB, more than the %.1f GB this machine has left for it: "
                           "every step runs on the quantized weights", str(dtype).removeprefix("torch."),
                           policy.quant_max_tokens, need / 1e9, max(budget, 0) / 1e9)
            policy.quant_max_tokens = limit
        else:
            model.materialize_dense()  # the steps above the crossover run on it
    if any(raced) and not model.has_dense_copy:
        model.drop_dense(mlp0)
    for lin in linears:
        if lin.quant_method is not None:
            lin.release_quantized()
    release_freed_memory()


def make_batch_invariant(model, kernels, int8_activations: bool = True) -> None:
    """``use_kernels`` for ``--batch-invariant`` (see :mod:`sloserve.model.invariant`): one
    linear method for every step, whatever its token count: the quantized weights where every
    layer has them, else the AMX bf16 GEMM; no crossover is measured. RoPE's tables come from
    a per-position cache. Sets ``model.invariant_how`` (for the start-up line).

    Raises:
        ValueError: dense weights and no AMX GEMM for them (float32, float16, or a CPU without
            AMX): oneDNN's per-row result depends on the step's row count.
    """
    quantized = all(lin.is_quantized for lin in model.linear_layers())
    use_kernels(model, kernels, int8_activations=int8_activations,
                quant_max_tokens=ALL_ROWS, amx_max_tokens=0 if quantized else ALL_ROWS)
    p = model.policy
    if quantized:
        model.invariant_how = (f"every step on the quantized weights "
                               f"({'int8' if int8_activations else 'float32'} activations)")
    elif p.amx_max_tokens:
        model.invariant_how = "every step on the AMX bfloat16 GEMM"
    else:
        dt = str(model.lm_head.weight.dtype).removeprefix("torch.")
        raise ValueError(
            f"--batch-invariant: the dense {dt} weights would run on oneDNN here, whose "
            f"per-row result depends on the step's row count; serve quantized weights (a GGUF, "
            f"or --quantization int8 / int4) or bfloat16 on a CPU with AMX")
    model.model.rotary_emb.table_cache = RopeTableCache(model.model.rotary_emb.inv_freq)


def _is_gate_up(model, lin) -> bool:
    return isinstance(lin, MergedColumnLinear)


def _given_or(given: int | None, available: bool, measure) -> int:
    return 0 if not available else measure() if given is None else given


def _onto_hugepages(linears: list[LinearBase]) -> torch.Tensor | None:
    """Every x16 weight (layers and LM head) moved into one buffer on 2 MB pages (see
    :mod:`sloserve.model.hugepages`: a decode step streams all of them), one layer at a time
    so that each layer's old copy is freed before the next is copied (an 8B model's 5.5 GB are
    not held twice); returns that buffer (bytes), or None where there are none."""
    methods = [lin.quant_method for lin in linears if lin.quant_method is not None]
    starts, total = [], 0
    for m in methods:
        starts.append(total)
        total += sum(hugepages.packed_size(w.packed) for w in m.weights
                     if isinstance(w, X16Weight))
    if not total:
        return None
    buf = hugepages.zeros((total,), torch.uint8, touch=False)  # every byte is written below

    def move(m, off: int) -> None:
        new = []
        for w in m.weights:
            if isinstance(w, X16Weight):
                w = dataclasses.replace(w, packed=hugepages.copy_into(buf, off, w.packed))
                off += hugepages.packed_size(w.packed)
            new.append(w)
        m.weights = new
    with ThreadPoolExecutor(max_workers=_loader_threads()) as ex:
        list(ex.map(move, methods, starts))
    return buf


def _loader_threads() -> int:
    return max(1, min(4, torch.get_num_threads()))


def warm_up(model, max_tokens: int, max_sampled: int) -> int:
    """Run each dense oneDNN GEMM shape a step of up to ``max_tokens`` tokens (``max_sampled``
    sampled rows for the LM head) can take once, on zeros, so that no request pays for creating
    it: oneDNN builds (JIT-compiles) a primitive the first time it sees a shape, which a server
    otherwise adds to the first step of every new :func:`dense_rows` bucket (vLLM warms its
    compile sizes at start-up for the same reason). Only for 16-bit dtypes (float32 steps are
    not padded to buckets); steps the quantized weights or the AMX GEMM serve need none.
    Returns the number of shapes run."""
    dtype = model.lm_head.weight.dtype
    if dtype == torch.float32 or model.kernels is None:
        return 0
    p = model.policy
    L = model.model.layers[0]
    ws = [L.self_attn.qkv_proj, L.self_attn.o_proj, L.mlp.gate_up_proj, L.mlp.down_proj]
    layer_weights = {tuple(w.weight.shape): w.weight.detach() for w in ws}.values()
    # quant_max_tokens is 0 without quantized weights: every step is dense then
    # and steps up to amx_max_tokens run the AMX GEMM, which has no per-shape state
    first = max(p.quant_max_tokens, p.amx_max_tokens) + 1
    lm_first = first if model.lm_head.quant_method is not None else p.amx_max_tokens + 1
    plan = ((first, max_tokens, layer_weights),
            (lm_first, max_sampled, [model.lm_head.weight.detach()]))
    runs = 0
    for first, last, weights in plan:
        for rows in sorted({dense_rows(t) for t in range(first, last + 1)}):
            for w in weights:
                F.linear(torch.zeros(rows, w.shape[1], dtype=dtype), w)
                runs += 1
    return runs
