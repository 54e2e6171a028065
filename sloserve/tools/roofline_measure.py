"""``sloserve roofline --measure``: time the engine's own forward pass against the roofline.

For each point the engine runs one real step of a given composition and the model forward is
timed (the runner output's ``forward_s``: the ``model(...)`` call alone, not input preparation or
sampling); the reported time is the median of ``repeats`` steps after ``warmup`` untimed ones.

- decode batch ``B`` at context ``C``: ``B`` requests are prefilled first in one untimed step (the
  token budget is raised to ``B x C``), then every timed step is decode-only with exactly ``B``
  sequences, all at the same context. The context grows by one per step, so
  the prompt length is chosen to centre the timed steps on ``C``: with ``repeats`` = 5 they run at
  contexts C-2 .. C+2 (context = tokens in the cache after the step, the new one included, as
  :class:`~sloserve.roofline.ops.Workload` counts it) and the theory is taken at ``C``.
- prefill chunk ``N``: one request of ``N`` prompt tokens scheduled in a single step (batch 1, no
  cached prefix), ``warmup`` + ``repeats`` fresh requests.

Theory for the same composition comes from :func:`sloserve.roofline.ops.operator_costs` with
activations in the engine's dtype and KV in the cache's dtype; the weight bytes and the peak are
those of the format the step is actually served in (:func:`served_format`):

- a step the fused path runs on quantized weights (at most ``quant_max_tokens`` tokens) reads the
  quantized bytes (codes + scales + offsets of every layer and the LM head: ``weight_bytes``) and
  its math is the kernels' int8 dot products, whose peak is measured here: the best FLOP/s of the
  product of layer 0's gate/up weight (cache-resident, so not bandwidth-limited) at the largest
  token count the path serves (2 M N K FLOP counted, as for a float GEMM);
- any other step reads the dense weights in the engine's dtype and its peak is the hardware's for
  that dtype (``local``: torch's matmul; where it has none, the fp32 peak and a note), also when
  the fused path runs it on the kernels' AMX GEMM (at most ``amx_max_tokens`` tokens: "AMX GEMM"
  in the table; the roof stays torch's matmul peak, the higher bar on the machines measured).

Bound time = ``max(FLOP / peak, bytes / bandwidth)``. The roof's bandwidth is the best probe pass
at start-up (:class:`~sloserve.roofline.hardware.ReadProbe`); a shared host's varies from minute
to minute, so each decode point is also set against the probe's median just before and after
its steps (``bandwidth_at``, ``efficiency_at``; a note lists them). Achieved FLOP/s = FLOP / measured, achieved
bytes/s = bytes / measured, efficiency = bound / measured (1 = on the roof).

This module imports torch and the engine; :mod:`sloserve.roofline` does not: ``sloserve roofline``
hands :func:`measure` to :func:`sloserve.roofline.cli.main` and imports this module only for
``--measure``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import asdict, dataclass, field

import torch

from sloserve.config import ROOFLINE_DTYPE_OF, EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.roofline.hardware import Hardware, ReadProbe, last_level_cache_bytes
from sloserve.roofline.models import ModelSpec
from sloserve.roofline.ops import Workload, operator_costs
from sloserve.roofline.roofline import roofline_point
from sloserve.roofline.units import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_flops_rate
from sloserve.tools.step_profile import time_decode_steps, time_prefill_steps

DECODE_BATCHES = (1, 4, 16, 64)
#: prefill points of --measure (tokens; 512 is the default step budget)
PREFILL_CHUNKS = (64, 256, 512, 1024)
CONTEXT_LEN = 256
#: read-bandwidth probe passes before and after each decode point's steps
PROBE_PASSES = 3


@dataclass(frozen=True)
class MeasuredPoint:
    """One measured step and its theory.

    Attributes: phase ("decode"/"prefill"), batch (sequences), seq_len (decode: context, prefill:
    chunk tokens), measured_s (median forward seconds), samples_s (all timed forwards), flops (FLOP),
    bytes (B), intensity (FLOP/B), achieved_flops_per_s, achieved_bytes_per_s, bound_s (roofline
    lower bound, s), bound ("memory"/"compute"), efficiency (bound_s / measured_s), contexts (decode:
    the context of each timed step).
    """

    phase: str
    batch: int
    seq_len: int
    measured_s: float
    samples_s: list[float]
    flops: float
    bytes: float
    intensity: float
    achieved_flops_per_s: float
    achieved_bytes_per_s: float
    bound_s: float
    bound: str
    efficiency: float
    contexts: list[int] = field(default_factory=list)
    format: str = ""     # the weight format and math served (see served_format)
    peak: float = 0.0    # FLOP/s of that math
    #: decode: the read bandwidth measured around the point's steps (median of ReadProbe
    #: passes just before and after them; the roof's is the best pass at start-up), and the
    #: efficiency against it (0: not measured)
    bandwidth_at: float = 0.0
    efficiency_at: float = 0.0

    @property
    def label(self) -> str:
        return f"decode B={self.batch}" if self.phase == "decode" else f"prefill {self.seq_len}"

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


@dataclass(frozen=True)
class Measurement:
    """All measured points plus what they were measured against."""

    model: str
    engine_dtype: str
    ops_dtype: str
    peak_dtype: str
    hardware: str
    peak: float
    bandwidth: float
    context_len: int
    warmup: int
    repeats: int
    torch_threads: int
    points: list[MeasuredPoint]
    notes: list[str]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["points"] = [p.to_dict() for p in self.points]
        return d

    def format(self) -> str:
        """The measured-vs-roofline table (:func:`format_measurement`)."""
        return format_measurement(self)


def theory(spec: ModelSpec, wl: Workload, hw: Hardware, peak_dtype: str, measured_s: float,
           samples: list[float], contexts: list[int] | None = None,
           served: "ServedFormat | None" = None) -> MeasuredPoint:
    """Combine a measured time with ops.py's FLOPs/bytes for ``wl`` and the roofline bound
    (``served``: the weight bytes and peak actually used; None: dense weights in ``wl``'s dtype
    at ``hw``'s ``peak_dtype`` peak)."""
    ops = operator_costs(spec, wl)
    flops = sum(o.flops for o in ops)
    nbytes = sum(o.bytes for o in ops)
    peak, fmt = hw.peak(peak_dtype), f"dense {wl.weight_dtype}"
    if served is not None:
        fmt = served.name
        if served.weight_bytes is not None:
            nbytes += served.weight_bytes - sum(o.weight_bytes for o in ops)
            peak = served.peak
    bw = hw.mem_bandwidth
    bound_s = max(flops / peak, nbytes / bw)
    intensity = flops / nbytes if nbytes else float("inf")
    return MeasuredPoint(wl.phase, wl.batch, wl.seq_len, measured_s, list(samples), flops, nbytes,
                         intensity, flops / measured_s, nbytes / measured_s, bound_s,
                         "compute" if intensity >= peak / bw else "memory",
                         bound_s / measured_s, list(contexts or []), fmt, peak)


@dataclass(frozen=True)
class ServedFormat:
    """How the engine serves a step's weights: name, bytes read per step (None: dense, counted by
    ops.py), and the FLOP/s peak of the math used."""

    name: str
    weight_bytes: int | None
    peak: float


def kernel_peak(model, tokens: int, repeats: int = 20) -> float:
    """Best FLOP/s of the quantized products the model serves at ``tokens`` rows: each of
    layer 0's products (Q/K/V, output, gate/up with its SwiGLU epilogue, down; 2 M N K FLOP a
    call) timed ``repeats`` times after one untimed call (cache-resident where it fits), the
    best of all. (Gate/up alone, the widest and the one with an epilogue, ran 4-7 % below the
    others: a 512-token prefill step then ran "above its peak", Zen 4, 8b shape.)"""
    import time
    best_rate = 0.0
    for lin in model.linear_layers()[:4]:  # layer 0's
        method = lin.quant_method
        if method is None:
            continue
        w = method.weights[0]
        n, k = w.shape
        x = torch.randn(tokens, k)
        method.linear(x, w)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            method.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        best_rate = max(best_rate, 2 * tokens * n * k / best)
    return best_rate


def served_format(eng: LLMEngine, tokens: int, peaks: dict) -> ServedFormat | None:
    """What a step of ``tokens`` query tokens reads and computes with (None: dense weights in the
    engine's dtype on torch's GEMM; weight_bytes None: dense weights on the AMX GEMM, the
    hardware's peak). ``peaks`` caches :func:`kernel_peak` per token count."""
    model = eng.runner.model
    if getattr(model, "kernels", None) is None:
        return None
    p = model.policy
    if p.quant_max_tokens < tokens <= p.amx_max_tokens:
        dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
        return ServedFormat(f"dense {dtype}, AMX", None, 0.0)
    method = model.model.layers[0].mlp.gate_up_proj.quant_method
    if method is None or tokens > p.quant_max_tokens:
        return None
    # the best of the largest step the path serves and this step's own row count (a 2048-row
    # product ran at 492 GFLOP/s where a 512-token prefill step reached 518: Zen 4)
    for m in {max(1, p.quant_max_tokens), tokens}:
        if m not in peaks:
            peaks[m] = kernel_peak(model, m)
    act = "int8" if method.int8_activations else "fp32"
    return ServedFormat(f"quantized, {act} act", model.quantized_weight_bytes,
                        max(peaks[max(1, p.quant_max_tokens)], peaks[tokens]))


def engine_config_for(config: EngineConfig, decode_batches, context_len: int, prefill_chunks,
                      warmup: int, repeats: int) -> EngineConfig:
    """``config`` with the token budget, sequence limit and KV blocks the points need."""
    bs = config.block_size
    max_b = max(decode_batches, default=1)
    max_n = max(prefill_chunks, default=1)
    blocks = max(max_b * math.ceil((context_len + warmup + repeats + 2) / bs),
                 math.ceil((max_n + 2) / bs)) + 4
    if config.num_kv_blocks is not None and config.num_kv_blocks < blocks:
        raise ValueError(f"num_kv_blocks={config.num_kv_blocks} is too few for these points; need {blocks}")
    return dataclasses.replace(
        config, num_kv_blocks=config.num_kv_blocks or blocks,
        # every decode batch's prompts go through in one step, so all its sequences start decoding
        # together at the same context (a smaller budget would interleave their decodes and prefills)
        max_num_batched_tokens=max(config.max_num_batched_tokens, max_n, max_b * context_len),
        max_num_seqs=max(config.max_num_seqs, max_b),
        max_model_len=config.max_model_len or max(max_n + 2, context_len + warmup + repeats + 4),
        enable_chunked_prefill=True, static_batching=False)


def measure(config: EngineConfig, spec: ModelSpec, hw: Hardware, *,
            decode_batches=DECODE_BATCHES, context_len: int = CONTEXT_LEN,
            prefill_chunks=PREFILL_CHUNKS, warmup: int = 2, repeats: int = 5,
            prefill_warmup: int = 1, prefill_repeats: int = 3) -> Measurement:
    """Build an engine from ``config`` and measure every point (see module docstring).

    ``spec`` must describe the same model (its shapes give the theory); ``hw`` gives the roof.

    Raises:
        ValueError: bad parameters or an engine dtype ops.py cannot count.
    """
    if min(warmup, prefill_warmup) < 0 or min(repeats, prefill_repeats) < 1:
        raise ValueError("warmup must be >= 0 and repeats >= 1")
    from sloserve.platform import choose_dtype
    dtype = choose_dtype(config.dtype).dtype  # "auto" -> the dtype the engine will pick here
    if dtype not in ROOFLINE_DTYPE_OF:
        raise ValueError(f"engine dtype {dtype!r}; known: {', '.join(ROOFLINE_DTYPE_OF)}")
    dt = ROOFLINE_DTYPE_OF[dtype]
    notes: list[str] = []
    peak_dtype = dt
    try:
        hw.peak(dt)
    except KeyError:
        peak_dtype = "fp32"
        notes.append(f"{hw.name} has no {dt} peak measured; the bound uses the fp32 peak "
                     f"({fmt_flops_rate(hw.peak('fp32'))})")
    if hw.name != "local":
        notes.append(f"timed on this machine's CPU, bound taken on {hw.name}")
    eng = LLMEngine(engine_config_for(config, decode_batches, context_len, prefill_chunks, warmup, repeats))
    # an int8 cache counts 1 byte per value (its per-entry scales, 4 bytes per 64, are not)
    kv_dt = ROOFLINE_DTYPE_OF.get(
        str(eng.runner.kv_caches[0].dtype).removeprefix("torch."), dt)
    peaks: dict = {}
    points: list[MeasuredPoint] = []
    probe = ReadProbe() if decode_batches else None
    for b in decode_batches:
        around = [probe.once() for _ in range(PROBE_PASSES)]
        steps = time_decode_steps(eng, b, context_len, warmup, repeats)
        around += [probe.once() for _ in range(PROBE_PASSES)]
        t, ctx = [x.forward_s for x in steps], [x.context for x in steps]
        p = theory(spec, Workload("decode", b, context_len, dt, dt, kv_dt), hw, peak_dtype,
                   statistics.median(t), t, ctx, served_format(eng, b, peaks))
        bw_at = statistics.median(around)
        bound_at = max(p.flops / p.peak if p.peak else 0.0, p.bytes / bw_at)
        points.append(dataclasses.replace(p, bandwidth_at=bw_at,
                                          efficiency_at=bound_at / p.measured_s))
    del probe
    for n in prefill_chunks:
        t = [x.forward_s for x in time_prefill_steps(eng, n, prefill_warmup, prefill_repeats)]
        points.append(theory(spec, Workload("prefill", 1, n, dt, dt, kv_dt), hw, peak_dtype,
                             statistics.median(t), t, served=served_format(eng, n, peaks)))
    if peaks:
        notes.append(f"quantized steps: weights {fmt_bytes(eng.runner.model.quantized_weight_bytes)} per step "
                     f"as stored; int8-dot peak measured on the engine's own kernel (cache-resident "
                     f"weight; a point's bound takes the best of the largest step's rows and its "
                     f"own): " + ", ".join(f"{fmt_flops_rate(pk)} at {m_tok} rows"
                                           for m_tok, pk in sorted(peaks.items())))
    notes.append(f"decode: timed steps at contexts {context_len - (repeats - 1) // 2}.."
                 f"{context_len + repeats // 2}, theory at {context_len}; prefill: batch 1, "
                 f"one step per chunk, median of {prefill_repeats} after {prefill_warmup} warm-up")
    at = [p for p in points if p.bandwidth_at]
    if at:
        notes.append("decode against the read bandwidth measured around each point (median of "
                     f"{PROBE_PASSES} probe passes before and {PROBE_PASSES} after its steps; the "
                     "roof's is the best pass at start-up, and this host's varies from minute to "
                     "minute): " + ", ".join(f"{p.label} {fmt_bandwidth(p.bandwidth_at)} -> "
                                              f"{100 * p.efficiency_at:.1f} %" for p in at))
    llc = last_level_cache_bytes()
    resident = [p.label for p in points if p.efficiency > 1 and p.bytes <= 2 * llc]
    over = [p.label for p in points if p.efficiency > 1 and p.bytes > 2 * llc]
    if resident:
        notes.append(f"efficiency above 100 % ({', '.join(resident)}) where a step's bytes fit "
                     f"twice the last-level cache ({llc / 2**20:.0f} MiB): read from the cache, "
                     f"not memory, so the memory roof does not bound them")
    if over:
        notes.append(f"FAILED MEASUREMENT: efficiency above 100 % ({', '.join(over)}): the engine "
                     f"ran faster than this roof allows, so the roof is wrong, not the engine fast "
                     f"(a bandwidth probe that read less than a step does, or the {peak_dtype} peak "
                     f"standing in for faster {dt} kernels); no efficiency here is trustworthy until "
                     f"`--remeasure` gives a roof every point stays under")
    return Measurement(eng.model_name, dtype, dt, peak_dtype, hw.name, hw.peak(peak_dtype),
                       hw.mem_bandwidth, context_len, warmup, repeats, torch.get_num_threads(),
                       points, notes)


def format_measurement(m: Measurement) -> str:
    """The measured-vs-roofline table."""
    L = [f"== measured: {m.model}, engine dtype {m.engine_dtype} (activations and dense weights "
         f"{m.ops_dtype}; quantized steps: see 'served as'), "
         f"{m.torch_threads} torch threads, model forward only, median after {m.warmup} warm-up",
         f"  roof: {m.hardware}, dense peak {m.peak_dtype} {fmt_flops_rate(m.peak)}, bandwidth "
         f"{fmt_bandwidth(m.bandwidth)}, balance {m.peak / m.bandwidth:.1f} FLOP/byte",
         f"  {'point':<16} {'served as':<24} {'measured':>11} {'FLOP':>12} {'bytes':>22} {'FLOP/byte':>10} "
         f"{'achieved FLOP/s':>16} {'achieved B/s':>14} {'bound':>10} {'':>7} {'efficiency':>10}"]
    for p in m.points:
        L.append(f"  {p.label:<16} {p.format:<24} {p.measured_s * 1e3:>8.3f} ms {fmt_flops(p.flops):>12} "
                 f"{fmt_bytes(p.bytes):>22} {p.intensity:>10.1f} {fmt_flops_rate(p.achieved_flops_per_s):>16} "
                 f"{fmt_bandwidth(p.achieved_bytes_per_s):>14} {p.bound_s * 1e3:>7.3f} ms {p.bound:>7} "
                 f"{100 * p.efficiency:>8.1f} %{'  >100 %' if p.efficiency > 1 else ''}")
    L.append("  efficiency = bound time / measured time; achieved = theoretical FLOP (bytes) / measured time")
    for n in m.notes:
        L.append(f"note: {n}")
    return "\n".join(L)
