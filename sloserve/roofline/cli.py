"""``sloserve roofline``: print the roofline / KV / capacity report as a table or JSON.

Every number printed carries its unit; byte counts show GiB and GB where they differ.
``--measure`` runs the engine, which this package does not import: ``sloserve roofline`` passes
:func:`sloserve.tools.roofline_measure.measure` in as ``main``'s ``measure``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from sloserve.argtypes import int_list as _int_list
from sloserve.config import DTYPE_CHOICES, LOAD_FORMAT_CHOICES, ROOFLINE_DTYPES
from sloserve.roofline.hardware import NIC_PRESETS, get_hardware, get_link, list_hardware
from sloserve.roofline.models import get_model, list_models
from sloserve.roofline.report import Plan, plan
from sloserve.roofline.textbook import golden_numbers, lecture_table, unit_slips
from sloserve.roofline.units import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_flops_rate, fmt_time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="sloserve roofline",
                                description="Roofline, KV-cache and capacity calculator.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hardware", default="H100-SXM", help=f"one of {', '.join(list_hardware())}")
    p.add_argument("--model", nargs="?", const=EMBEDDED, default=None,
                   help=f"preset ({', '.join(list_models())}), config.json / folder, .gguf, or "
                        f"'{EMBEDDED}' (the engine's embedded SmolLM2-135M GGUF; also what --model "
                        f"without a value means). Default: Llama-3-8B, or {EMBEDDED} with --measure")
    p.add_argument("--batch", type=int, default=1, help="decode batch (sequences)")
    p.add_argument("--context-len", type=int, default=4096, help="decode context length (tokens)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prefill prompt length (tokens)")
    p.add_argument("--prefill-batch", type=int, default=1, help="prefill batch (sequences)")
    p.add_argument("--weight-dtype", default="bf16", choices=ROOFLINE_DTYPES)
    p.add_argument("--kv-dtype", default=None, choices=ROOFLINE_DTYPES,
                   help="default: the weight dtype")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    p.add_argument("--memory-efficiency", type=float, default=1.0,
                   help="fraction of peak bandwidth achievable (0-1]")
    p.add_argument("--compute-efficiency", type=float, default=1.0,
                   help="fraction of peak FLOP/s achievable (0-1]")
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (0-1]")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="GiB per GPU kept back for activations etc.")
    p.add_argument("--link", action="append", default=None,
                   help=f"KV transfer link: {', '.join(NIC_PRESETS)}, nvlink (repeatable; "
                        "default nic-400g and nvlink)")
    p.add_argument("--remeasure", action="store_true", help="re-measure the local hardware")
    p.add_argument("--textbook", action="store_true",
                   help="print the lecture's worked numbers and 7-row table instead")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g = p.add_argument_group("measure mode (runs the engine's forward pass; imports torch)")
    g.add_argument("--measure", action="store_true",
                   help="time the engine's model forward for decode batches and prefill chunks "
                        "and compare with the roofline")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="engine dtype for --measure (weights, activations and KV counted in it; "
                        "auto: what the engine picks on this CPU)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMAT_CHOICES,
                   help="engine load format for --measure")
    g.add_argument("--measure-batches", type=_int_list, default=[1, 4, 16, 64],
                   help="decode batches, comma-separated (default 1,4,16,64)")
    g.add_argument("--measure-context-len", type=int, default=256,
                   help="decode context length for --measure (tokens, default 256)")
    g.add_argument("--measure-chunks", type=_int_list, default=None,
                   help="prefill chunk sizes, comma-separated (default 64,256,512,1024: "
                        "sloserve.tools.roofline_measure.PREFILL_CHUNKS)")
    g.add_argument("--warmup", type=int, default=2, help="untimed decode steps per point")
    g.add_argument("--repeats", type=int, default=5, help="timed decode steps per point (median)")
    g.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per chunk (median)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the log-log roofline chart (with --measure: the measured points too)")
    return p


EMBEDDED = "embedded"


def _resolve_model(name: str | None, measure: bool) -> tuple[str, str | None]:
    """(spec source, engine model) for ``--model``; engine model None = the embedded GGUF."""
    if name is None:
        name = EMBEDDED if measure else "Llama-3-8B"
    if name.lower() == EMBEDDED:
        from sloserve.embedded import default_model_path

        return default_model_path(), None
    return name, name


def main(argv: list[str] | None = None, measure: Callable[..., Any] | None = None) -> int:
    """Entry point; returns the exit code (2 on bad arguments).

    Args:
        argv: the arguments after ``sloserve roofline``.
        measure: runs the engine for ``--measure`` (:func:`sloserve.tools.roofline_measure.measure`
            or one with its signature, returning an object with ``to_dict()`` and ``format()``);
            None: ``--measure`` is refused with exit code 2.
    """
    p = build_parser()
    a = p.parse_args(argv)
    for name in ("batch", "context_len", "prompt_len", "prefill_batch", "tp"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("memory_efficiency", "compute_efficiency", "memory_fraction"):
        if not 0 < getattr(a, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    if a.reserve_gib < 0:
        p.error("--reserve-gib must be >= 0")
    if a.measure_context_len < 2 or a.warmup < 0 or a.repeats < 1 or a.prefill_repeats < 1:
        p.error("--measure-context-len must be >= 2, --warmup >= 0, --repeats/--prefill-repeats >= 1")
    if a.textbook:
        out = {"golden": golden_numbers(), "lecture_table": [r.to_dict() for r in lecture_table()],
               "unit_slips": unit_slips()}
        print(json.dumps(out, indent=1) if a.json else format_textbook())
        return 0
    try:
        hw = get_hardware(a.hardware, remeasure=a.remeasure)
        spec_src, engine_model = _resolve_model(a.model, a.measure)
        spec = get_model(spec_src)
        if a.measure and engine_model is not None and not os.path.exists(engine_model):
            raise ValueError(f"--measure needs a model the engine can load ('{EMBEDDED}', a .gguf "
                             f"or a Hugging Face folder), not the preset {engine_model!r}")
        links = {n: get_link(n, hw) for n in (a.link or ["nic-400g", "nvlink"])
                 if not (n == "nvlink" and hw.link is None and not a.link)}
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    pl = plan(spec, hw, batch=a.batch, prompt_len=a.prompt_len, context_len=a.context_len,
              prefill_batch=a.prefill_batch, weight_dtype=a.weight_dtype, kv_dtype=a.kv_dtype,
              tp=a.tp, memory_efficiency=a.memory_efficiency,
              compute_efficiency=a.compute_efficiency, memory_fraction=a.memory_fraction,
              reserve_gib=a.reserve_gib, links=links)
    m = None
    if a.measure:
        from sloserve.config import EngineConfig

        if measure is None:
            print("error: --measure runs the engine: use `sloserve roofline --measure`", file=sys.stderr)
            return 2
        chunks = {"prefill_chunks": a.measure_chunks} if a.measure_chunks else {}
        try:
            m = measure(EngineConfig(model=engine_model, dtype=a.dtype, load_format=a.load_format), spec,
                        hw, decode_batches=a.measure_batches, context_len=a.measure_context_len,
                        warmup=a.warmup, repeats=a.repeats, prefill_repeats=a.prefill_repeats, **chunks)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e.args[0] if e.args else e}", file=sys.stderr)
            return 2
    if a.plot:
        from sloserve.roofline.plot import plot_from_plan

        plot_from_plan(a.plot, pl, m)
    if a.json:
        d = pl.to_dict()
        if m is not None:
            d["measure"] = m.to_dict()
        if a.plot:
            d["plot"] = a.plot
        print(json.dumps(d, indent=1))
    else:
        print(format_plan(pl) + (("\n" + m.format()) if m is not None else "")
              + (f"\nplot written to {a.plot}" if a.plot else ""))
    return 0


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def format_plan(pl: Plan) -> str:
    """The human-readable report."""
    m, hw = pl.model, pl.hardware
    L: list[str] = []
    L.append(f"== hardware: {hw['name']}  ({hw['source']})")
    L.append(f"  peak {pl.dtype}: {fmt_flops_rate(pl.prefill.point.peak)}"
             f"   memory bandwidth: {fmt_bandwidth(hw['mem_bandwidth'])}   memory: {fmt_bytes(hw['mem_bytes'])}")
    L.append(f"  balance point: {pl.balance:.1f} FLOP/byte")
    L.append(f"== model: {m['name']}  {m['attention_kind']}  params {m['num_params'] / 1e9:.3f} B"
             + (f" (active {m['active_params'] / 1e9:.3f} B)" if m['active_params'] != m['num_params'] else ""))
    L.append(f"  layers {m['num_layers']}, hidden {m['hidden_size']}, heads {m['num_heads']}, "
             f"kv heads {m['num_kv_heads']}, head dim {m['head_dim']}, intermediate "
             f"{m['intermediate_size']}, vocab {m['vocab_size']}")
    if m.get("mla"):
        x = m["mla"]
        L.append(f"  MLA: q_lora {x['q_lora_rank']}, kv_lora {x['kv_lora_rank']}, rope {x['qk_rope_head_dim']}, "
                 f"nope {x['qk_nope_head_dim']}, v {x['v_head_dim']}")
    L.append(f"  weights: {fmt_bytes(pl.weight_bytes)} total, {fmt_bytes(pl.weight_bytes_per_gpu)} per GPU (TP={pl.tp})")
    L.append("== KV cache")
    L.append("  per token: " + ", ".join(f"{'fp16/bf16' if d == 'bf16' else d} {v:,.0f} B" for d, v in pl.kv_bytes_per_token.items()))
    k = pl.kv_total
    L.append(f"  {k['batch']} x {k['seq_len']} tokens ({k['kv_dtype']}): {fmt_bytes(k['total_bytes'])} total, "
             f"{fmt_bytes(k['per_gpu_bytes'])} per GPU (TP={pl.tp})")
    for title, a, g in (("prefill", pl.prefill, pl.prefill_per_gpu), ("decode", pl.decode, pl.decode_per_gpu)):
        w = a.workload
        what = f"batch {w.batch} x {w.seq_len} prompt tokens" if title == "prefill" else \
            f"batch {w.batch}, context {w.seq_len} tokens"
        L.append(f"== {title}: {what} (weights {w.weight_dtype}, KV {w.kv_dtype})")
        L.append(f"  {'operator':<10} {'FLOP':>14} {'weights':>24} {'activations':>24} {'KV':>24} "
                 f"{'FLOP/byte':>11} {'bound':>8}")
        for o in a.ops:
            L.append(f"  {o.name:<10} {fmt_flops(o.flops):>14} {fmt_bytes(o.weight_bytes):>24} "
                     f"{fmt_bytes(o.act_bytes):>24} {fmt_bytes(o.kv_bytes):>24} {o.intensity:>11.1f} "
                     f"{a.op_points[o.name].bound:>8}")
        p = a.point
        L.append(f"  total: {fmt_flops(p.flops)}, {fmt_bytes(p.bytes)}, intensity {p.intensity:.1f} FLOP/byte, "
                 f"{p.bound}-bound")
        L.append(f"  per GPU: attainable {fmt_flops_rate(g.attainable)}, MFU {_pct(g.mfu)}, "
                 f"time >= {fmt_time(g.time)} at 100 % efficiency")
    d = pl.decode_bound
    L.append("== lower bounds (with the given efficiencies)")
    L.append(f"  prefill time >= {fmt_time(pl.prefill_seconds)}   (TTFT floor)")
    L.append(f"  decode step (TPOT) >= {fmt_time(d.tpot)}   user <= {d.user_tokens_per_s:.1f} tokens/s   "
             f"batch <= {d.batch_tokens_per_s:.1f} tokens/s")
    L.append(f"== capacity per GPU: budget {fmt_bytes(pl.memory_budget_per_gpu)} - weights "
             f"{fmt_bytes(pl.weight_bytes_per_gpu)} - reserve {fmt_bytes(pl.reserve_bytes)}")
    L.append("  " + ", ".join(f"ctx {s} tokens: max batch {b}" for s, b in pl.max_batch.items()))
    if pl.transfers:
        L.append("== KV transfer after prefill (disaggregation), per prompt batch")
        for name, t in pl.transfers.items():
            L.append(f"  {name} ({fmt_bandwidth(t.link_bandwidth)}): {fmt_bytes(t.kv_bytes)}, eager +"
                     f"{fmt_time(t.eager_exposed)}, layer-wise pipelined +{fmt_time(t.pipelined_exposed)}")
    for n in pl.notes:
        L.append(f"note: {n}")
    return "\n".join(L)


_SUFFIX_UNITS = (("_flop_per_byte", "FLOP/byte", 1), ("_flop_per_s", "FLOP/s", 1), ("_mfu", "%", 100),
                 ("_bytes_per_token", "B/token", 1), ("_GiB", "GiB", 1), ("_GB", "GB", 1),
                 ("_MiB", "MiB", 1), ("_s", "ms", 1e3))


def _with_unit(key: str, v: float) -> str:
    """A golden number with the unit its key names (``..._GiB`` -> GiB, ``..._mfu`` -> %)."""
    for suffix, unit, scale in _SUFFIX_UNITS:
        if key.endswith(suffix):
            return f"{v * scale:,.6g} {unit}"
    return f"{v:,.6g}"


def format_textbook() -> str:
    """The lecture's worked numbers, exact, and the two unit slips."""
    L = ["== golden numbers"]
    for k, v in golden_numbers().items():
        L.append(f"  {k:<48} {_with_unit(k, v)}")
    L.append("== lecture table (weights-only, fp16)")
    L.append(f"  {'row':<20} {'hardware':<14} {'FLOP/byte':>10} {'attainable':>16} {'MFU':>9} {'bound':>8} {'time >=':>12}")
    for r in lecture_table():
        L.append(f"  {r.label:<20} {r.hardware:<14} {r.intensity:>10.1f} {fmt_flops_rate(r.attainable):>16} "
                 f"{_pct(r.mfu):>9} {r.bound:>8} {fmt_time(r.time):>12}")
    s = unit_slips()
    k, t = s["kv_32k_70b"], s["tpot_70b_tp8_h100"]
    L.append("== unit slips in the text")
    L.append(f"  32K-token 70B context KV: {k['bytes']:,} B = {k['GiB']:.2f} GiB = {k['GB']:.2f} GB "
             f"(text: {k['text_GB']} GB = {k['text_bytes']:,} B, 32K read as 32,000 tokens)")
    L.append(f"  70B TP=8 H100 TPOT bound at 80 % bandwidth: exact {fmt_time(t['exact_seconds'])} "
             f"({t['exact_user_tokens_per_s']:.1f} tokens/s); text {fmt_time(t['text_seconds'])} "
             f"({t['text_user_tokens_per_s']:.1f} tokens/s) with 20 GiB taken as 20 GB")
    return "\n".join(L)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
