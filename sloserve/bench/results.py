"""Benchmark results as ``vllm bench serve`` writes them: the console summary and the JSON file.

The JSON has the same keys, in the same order, as the result file of ``vllm bench serve``
(vllm 0.32), so tools that read those read ours. With ``--save-detailed`` it also holds vLLM's
per-request arrays (``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``start_times``,
``generated_texts``, ``errors``; times in s, ``start_times`` on the client's perf_counter clock)
and two sloserve arrays at the end, ``chunk_times`` (perf_counter of every content chunk) and
``tags`` (workload labels), which the plots use.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any, Sequence

from sloserve.bench.metrics import METRIC_NAMES, METRICS, BenchmarkMetrics

#: vLLM's per-request keys, written only with --save-detailed
DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
                 "errors")
#: sloserve's own per-request keys, written only with --save-detailed
EXTRA_DETAILED_KEYS = ("chunk_times", "tags")


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def stats_dict(m: BenchmarkMetrics, metrics: Sequence[str] = METRICS) -> dict[str, Any]:
    """``mean_/median_/std_/pNN_<metric>_ms`` for each of ``metrics``."""
    d: dict[str, Any] = {}
    for name in metrics:
        s = m.stats[name]
        d[f"mean_{name}_ms"] = s.mean
        d[f"median_{name}_ms"] = s.median
        d[f"std_{name}_ms"] = s.std
        for p, v in s.percentiles:
            d[f"p{_pword(p)}_{name}_ms"] = v
    return d


def metrics_dict(m: BenchmarkMetrics, metrics: Sequence[str] = METRICS) -> dict[str, Any]:
    """The aggregate (non-list) keys of vLLM's result JSON (latencies in ms, throughputs per s)."""
    return {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        **stats_dict(m, metrics),
    }


def result_json(run: Any, *, label: str | None = None, backend: str = "openai",
                tokenizer_id: str | None = None, detailed: bool = False,
                metrics: Sequence[str] = METRICS,
                metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result file's content for a :class:`~sloserve.bench.runner.BenchmarkRun`, keys in
    vLLM's order (``vllm bench serve`` 0.32): run settings, totals and throughputs, ``latencies``
    and ``queue_times`` (s, per request), [per-request arrays with ``detailed``], peaks, ``rtfx``
    (always 0: no audio), then the statistics of ``metrics``.

    Args:
        run: the finished run.
        label: free-form label (vLLM's ``--label``).
        backend: vLLM's backend name (``openai`` or ``openai-chat``).
        tokenizer_id: tokenizer used for the prompts.
        detailed: also write the per-request arrays (vLLM's ``--save-detailed``) and sloserve's
            ``chunk_times`` (perf_counter s of each content chunk) and ``tags``.
        metrics: metrics whose statistics are written (vLLM's ``--percentile-metrics``).
        metadata: extra key-values at the top level (vLLM's ``--metadata``).
    """
    cfg, m, recs = run.config, run.metrics, run.records
    out: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": cfg.model,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(run.requests),
        "request_rate": cfg.request_rate if cfg.request_rate != float("inf") else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
    }
    out.update(metadata or {})
    agg = metrics_dict(m, ())
    peaks = {k: agg.pop(k) for k in ("max_output_tokens_per_s", "max_concurrent_requests")}
    out.update(agg)
    if detailed:
        out.update({
            "input_lens": [r.prompt_len for r in recs],
            "output_lens": [r.output_tokens if r.success else 0 for r in recs],
            "ttfts": [r.ttft for r in recs],
            "itls": [r.itl for r in recs],
        })
    out["latencies"] = [r.latency for r in recs]
    if detailed:
        out["start_times"] = [r.send_time for r in recs]
    out["queue_times"] = [r.queue_time for r in recs]
    if detailed:
        out["generated_texts"] = [r.generated_text for r in recs]
        out["errors"] = [r.error for r in recs]
    out.update(peaks)
    out["rtfx"] = 0.0
    out.update(stats_dict(m, metrics))
    if detailed:
        out["chunk_times"] = [list(r.chunk_times) for r in recs]
        out["tags"] = [r.tag for r in recs]
    return out


def save_json(result: dict[str, Any], path: str) -> str:
    """Write ``result`` to ``path`` (folders created); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return path


def format_summary(m: BenchmarkMetrics, title: str = "Serving Benchmark Result",
                   metrics: tuple[str, ...] = METRICS) -> str:
    """The console summary, laid out as ``vllm bench serve`` prints it, with a section for each
    of ``metrics`` (of ttft, tpot, itl, e2el)."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(k: str, v: Any, fmt: str = "") -> None:
        lines.append(f"{k:<40}{format(v, fmt):<20}" if fmt else f"{k:<40}{v!s:<20}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration, ".2f")
    row("Total input tokens:", m.total_input)
    row("Total generated tokens:", m.total_output)
    row("Request throughput (req/s):", m.request_throughput, ".2f")
    if m.request_goodput is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in m.goodput_slos.items())
        key = f"Request goodput (req/s) [{slo}]:"
        row(key if len(key) < 40 else "Request goodput (req/s):", m.request_goodput, ".2f")
        row("Good requests:", f"{m.num_good} of {m.completed + m.failed}")
    row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total token throughput (tok/s):", m.total_token_throughput, ".2f")
    for name in metrics:
        s = m.stats[name]
        lines.append(f"{' ' + METRIC_NAMES[name] + ' ':-^60}")
        row(f"Mean {name.upper()} (ms):", s.mean, ".2f")
        row(f"Median {name.upper()} (ms):", s.median, ".2f")
        for p, v in s.percentiles:
            row(f"P{_pword(p)} {name.upper()} (ms):", v, ".2f")
        row(f"Max {name.upper()} (ms):", s.max, ".2f")
    if m.errors:
        lines.append(f"{' Errors ':-^60}")
        for msg, n in sorted(m.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"{n:>5} x {msg[:200]}")
    lines.append("=" * 60)
    return "\n".join(lines)
