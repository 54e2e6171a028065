"""``sloserve bench`` (one run) and ``sloserve bench sweep`` (a series of rates or concurrencies)
against any OpenAI-compatible server. Flags follow ``vllm bench serve``."""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import replace
from datetime import datetime
from typing import Any

from sloserve.bench.datasets import PromptFactory
from sloserve.bench.metric_args import add_metric_args, check_metric_flags, shown_metrics
from sloserve.slo import add_goodput_arg, parse_goodput
from sloserve.argtypes import client_port as _port
from sloserve.argtypes import pos_float as _pos_float
from sloserve.argtypes import pos_int as _pos_int
from sloserve.argtypes import rate as _rate
from sloserve.bench.workload_args import (add_workload_args, arrival_process, build_workload,
                                         check_workload_flags)


def add_client_args(p: argparse.ArgumentParser) -> None:
    """Server, request and output flags."""
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None, help="server root (default http://HOST:PORT)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--endpoint", default=None,
                   choices=["/v1/completions", "/v1/chat/completions"])
    s.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai = /v1/completions, openai-chat = /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name sent (default: the server's first)")
    s.add_argument("--tokenizer", default=None,
                   help="GGUF file or HF folder (default: the served model's path, else the "
                        "embedded SmolLM2)")
    r = p.add_argument_group("requests")
    r.add_argument("--ignore-eos", action="store_true", help="every output runs to max_tokens")
    r.add_argument("--ignore-priority", action="store_true",
                   help="send no request's priority (a trace's `priority` field), e.g. to a "
                        "server on --scheduling-policy fcfs, which refuses one")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--skip-initial-test", action="store_true")
    r.add_argument("--request-timeout", type=_pos_float, default=600.0,
                   help="seconds to wait for the next bytes of a response before the request "
                        "fails (a stalled server does not hang the run)")
    o = p.add_argument_group("metrics and output")
    add_metric_args(o)
    add_goodput_arg(o, "; goodput = requests/s that meet it")
    o.add_argument("--save-result", action="store_true")
    o.add_argument("--save-detailed", action="store_true", help="per-request arrays in the JSON")
    o.add_argument("--result-dir", default=".")
    o.add_argument("--result-filename", default=None)
    o.add_argument("--label", default=None)
    o.add_argument("--plot-dir", default=None, help="write CDF and ITL-timeline PNGs here")
    o.add_argument("--report", default=None, metavar="FILE.html",
                   help="one self-contained HTML page: summary table, TTFT/TPOT CDFs, ITL "
                        "timeline (a sweep: every point and the Pareto plot), the command "
                        "and the machine; no outside script, opens offline")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _check_flags(a: argparse.Namespace) -> dict[str, float]:
    """Validate the flags that need no server; returns the goodput SLOs. Raises ValueError."""
    slos = parse_goodput(a.goodput)
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    check_metric_flags(a)
    check_workload_flags(a)
    report_dir = os.path.dirname(os.path.abspath(a.report)) if a.report else None
    if a.report and os.path.isdir(a.report):
        raise ValueError(f"--report {a.report}: a folder, not a file path")
    for d in (a.result_dir, a.plot_dir, report_dir):
        if d:
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot create output folder {d!r}: {e}") from None
    return slos


def _setup(a: argparse.Namespace):
    """(BenchConfig template, workload, tokenizer id) from flags. Raises ValueError etc."""
    from sloserve.bench.runner import BenchConfig
    from sloserve.bench.tokenizer import resolve_tokenizer, server_models
    slos = _check_flags(a)
    base = a.base_url or f"http://{a.host}:{a.port}"
    endpoint = a.endpoint or ("/v1/chat/completions" if a.backend == "openai-chat"
                              else "/v1/completions")
    models = server_models(base)
    model = a.model or (models[0]["id"] if models else None)
    if not model:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    tok, tok_id = resolve_tokenizer(a.tokenizer, models, model)
    factory = PromptFactory(tok, seed=a.seed)
    reqs = build_workload(a, factory)
    cfg = BenchConfig(base_url=base, model=model, endpoint=endpoint, request_rate=a.request_rate,
                      burstiness=a.burstiness, arrival=arrival_process(a),
                      max_concurrency=a.max_concurrency, seed=a.seed, ignore_eos=a.ignore_eos,
                      ignore_priority=a.ignore_priority,
                      percentiles=tuple(a.metric_percentiles), goodput=slos,
                      extra_body={"temperature": a.temperature},
                      initial_test=not a.skip_initial_test, progress=not a.disable_tqdm,
                      timeout_s=a.request_timeout)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    return cfg, reqs, tok_id, count


def _backend(cfg) -> str:
    return "openai-chat" if cfg.endpoint.endswith("chat/completions") else "openai"


def _bench(a: argparse.Namespace) -> int:
    from sloserve.bench.results import format_summary, result_json, save_json
    from sloserve.bench.runner import run_benchmark
    shown = shown_metrics(a)
    cfg, reqs, tok_id, count = _setup(a)
    print(f"bench: {len(reqs)} {a.dataset_name} requests to {cfg.url} (model {cfg.model}), "
          f"rate {cfg.request_rate:g} req/s ({cfg.arrival}), max concurrency "
          f"{cfg.max_concurrency or 'unlimited'}, tokenizer {tok_id}", file=sys.stderr)
    run = run_benchmark(cfg, reqs, count)
    print(format_summary(run.metrics, metrics=shown))
    detailed = a.save_detailed or bool(a.plot_dir) or bool(a.report)
    res = result_json(run, label=a.label, backend=_backend(cfg), tokenizer_id=tok_id,
                      detailed=detailed, metrics=shown)
    if a.save_result or a.save_detailed:
        name = a.result_filename or (f"{_backend(cfg)}-{cfg.request_rate:g}qps-"
                                     f"{cfg.model.replace('/', '_')}-"
                                     f"{datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
        saved = res if a.save_detailed else result_json(run, label=a.label, backend=_backend(cfg),
                                                        tokenizer_id=tok_id, metrics=shown)
        print(f"result: {save_json(saved, os.path.join(a.result_dir, name))}")
    if a.plot_dir:
        from sloserve.bench.plots import plot_cdfs, plot_itl_timeline
        label = a.label or cfg.model
        print("plots:", plot_cdfs({label: res}, os.path.join(a.plot_dir, "cdf.png")),
              plot_itl_timeline({label: res}, os.path.join(a.plot_dir, "itl_timeline.png")))
    if a.report:
        from sloserve.bench.report import write_report
        print("report:", write_report(a.report, {a.label or cfg.model: res},
                                      title=f"sloserve bench: {cfg.model}", slos=cfg.goodput,
                                      argv=a.command))
    return 0 if run.metrics.completed else 1


def _sweep(a: argparse.Namespace) -> int:
    from sloserve.bench.results import metrics_dict, result_json, save_json
    from sloserve.bench.runner import run_benchmark
    from sloserve.bench.sweep import write_sweep
    if bool(a.request_rates) == bool(a.max_concurrencies):
        raise ValueError("give exactly one of --request-rates and --max-concurrencies")
    if a.plot_dir or a.result_filename or a.save_result:
        raise ValueError("bench sweep always writes its results and plots under --result-dir; "
                         "--plot-dir, --result-filename and --save-result are for single runs")
    if 99.0 not in a.metric_percentiles:  # the table, frontier and operating point use P99
        a.metric_percentiles = [*a.metric_percentiles, 99.0]
    shown = shown_metrics(a)
    cfg0, reqs, tok_id, count = _setup(a)
    axis = "request_rate" if a.request_rates else "max_concurrency"
    points = a.request_rates or a.max_concurrencies
    rows: list[dict[str, Any]] = []
    reports: dict[str, dict[str, Any]] = {}
    os.makedirs(a.result_dir, exist_ok=True)
    for pt in points:
        cfg = replace(cfg0, **{axis: pt})
        print(f"--- sweep point {axis}={pt:g}", file=sys.stderr)
        run = run_benchmark(cfg, reqs, count)
        res = result_json(run, label=a.label, backend=_backend(cfg), tokenizer_id=tok_id,
                          detailed=a.save_detailed or bool(a.report), metrics=shown)
        save_json(res, os.path.join(a.result_dir, f"sweep-{axis}-{pt:g}.json"))
        if a.report:
            reports[f"{axis} {pt:g}"] = res
        rows.append({"point": pt, **metrics_dict(run.metrics)})
        m = run.metrics
        print(f"    {axis}={pt:g}: {m.completed} completed, {m.failed} failed", file=sys.stderr)
        for msg, n in sorted(m.errors.items(), key=lambda kv: -kv[1])[:5]:
            print(f"    {n} x {msg[:200]}", file=sys.stderr)
        cfg0 = replace(cfg0, initial_test=False)  # the server is warm after the first point
    sweep = write_sweep(rows, axis, parse_goodput(a.goodput), a.result_dir,
                        f"{cfg0.model}: sweep over {axis}")
    if a.report:
        from sloserve.bench.report import write_report
        print("report:", write_report(a.report, reports, sweep=sweep, slos=cfg0.goodput,
                                      argv=a.command,
                                      title=f"sloserve bench sweep: {cfg0.model} over {axis}"))
    empty = [r["point"] for r in rows if r["completed"] == 0]
    if empty:
        print(f"sloserve bench sweep: no request completed at {axis} = "
              f"{', '.join(f'{p:g}' for p in empty)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sloserve bench [sweep] ...``; returns the exit code (2: bad settings)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sweep = argv[:1] == ["sweep"]
    p = argparse.ArgumentParser(allow_abbrev=False, prog="sloserve bench sweep" if sweep else "sloserve bench",
                                description=(__doc__ if not sweep else
                                             "Benchmarks at a series of request rates or "
                                             "concurrencies; writes the table, the Pareto "
                                             "frontier and the operating point."))
    add_client_args(p)
    add_workload_args(p)
    if sweep:
        p.add_argument("--request-rates", type=lambda v: [_rate(x) for x in v.split(",")],
                       default=None, help="e.g. 0.5,1,2,4")
        p.add_argument("--max-concurrencies", type=lambda v: [_pos_int(x) for x in v.split(",")],
                       default=None, help="e.g. 1,4,16")
        argv = argv[1:]
    a = p.parse_args(argv)
    a.command = ["sloserve", "bench", *(["sweep"] if sweep else []), *argv]  # (for --report)
    if sweep and a.result_dir == ".":
        a.result_dir = "sweep-results"
    try:
        return _sweep(a) if sweep else _bench(a)
    except KeyboardInterrupt:
        print("sloserve bench: interrupted; nothing saved", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, ConnectionError, OSError) as e:
        print(f"sloserve bench: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # BenchmarkError
        print(f"sloserve bench: error: {e}", file=sys.stderr)
        return 1
