"""``--report FILE.html``: one self-contained page of a bench run, a sweep or a simulation.

Everything is inline (the charts are SVG drawn by matplotlib, no script, no outside style,
image or font), so the page opens offline and can be mailed as one file: a summary table of
each run (the result JSON's own numbers; each cell keeps the exact value in ``data-value``),
the TTFT / TPOT CDFs and the ITL timeline when the result is detailed, the Pareto plot of a
sweep, the command line and the machine it ran on.
"""
from __future__ import annotations

import html
import json
import os
import platform
import shlex
import sys
import time
from typing import Any, Sequence

#: the summary's columns: (result key, heading, decimals)
SUMMARY = [("completed", "completed", 0), ("failed", "failed", 0),
           ("duration", "duration (s)", 2),
           ("request_throughput", "requests/s", 3), ("request_goodput", "goodput (req/s)", 3),
           ("output_throughput", "output tok/s", 1),
           ("mean_ttft_ms", "mean TTFT (ms)", 1), ("median_ttft_ms", "P50 TTFT", 1),
           ("p99_ttft_ms", "P99 TTFT", 1), ("mean_tpot_ms", "mean TPOT (ms)", 1),
           ("median_tpot_ms", "P50 TPOT", 1), ("p99_tpot_ms", "P99 TPOT", 1),
           ("median_itl_ms", "P50 ITL (ms)", 1), ("p99_itl_ms", "P99 ITL", 1),
           ("max_itl_ms", "max ITL", 1), ("median_e2el_ms", "P50 E2E (ms)", 1),
           ("p99_e2el_ms", "P99 E2E", 1)]

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #1c2330; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
td, th { border: 1px solid #d5dae1; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f1f3f6; }
figure { margin: 12px 0; } figure svg { max-width: 100%; height: auto; }
code, pre { background: #f1f3f6; padding: 2px 4px; white-space: pre-wrap; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 14px; }
dt { color: #6b7585; }
"""


def _cell(value: Any, decimals: int) -> str:
    """A summary cell: the value rounded for the eye, exact (as the result JSON writes it) in
    ``data-value``."""
    if value is None or value == "":
        return '<td data-value="">-</td>'
    if hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = f"{value:,.{decimals}f}" if isinstance(value, float) else f"{value:,}"
        return f'<td data-value="{json.dumps(value)}">{shown}</td>'
    return f"<td>{html.escape(str(value))}</td>"


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    cols = [c for c in SUMMARY if any(c[0] in r for r in results.values())]
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _ in cols)
    rows = []
    for label, r in results.items():
        cells = "".join(_cell(r.get(k), d) for k, _, d in cols)
        rows.append(f'<tr data-label="{html.escape(label)}"><td>{html.escape(label)}</td>'
                    f"{cells}</tr>")
    return (f'<table class="summary"><tr><th>run</th>{head}</tr>' + "".join(rows) + "</table>")


def machine() -> dict[str, str]:
    """Where it ran: host, CPU model and count, OS, Python, sloserve's version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import version
        ver = version("sloserve")
    except Exception:  # not installed as a package
        ver = "unknown"
    return {"host": platform.node(), "cpu": f"{cpu} ({os.cpu_count()} CPUs visible)",
            "os": platform.platform(), "python": platform.python_version(), "sloserve": ver,
            "written": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _figure(svg: str, caption: str) -> str:
    return (f'<figure class="chart" data-chart="{html.escape(caption)}">{svg}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def write_report(path: str, results: dict[str, dict[str, Any]], *, title: str,
                 argv: Sequence[str] | None = None, sweep: dict[str, Any] | None = None,
                 slos: dict[str, float] | None = None) -> str:
    """Write the page to ``path`` and return it.

    Args:
        results: result JSON dicts (``sloserve bench --save-detailed``'s format) by label; the
            charts of per-request data are drawn for those with per-request arrays.
        title: the page's heading.
        argv: the command line (default: this process's).
        sweep: ``{"rows", "fronts", "operating_point", "axis"}`` of a sweep: its Pareto plot.
        slos: the goodput SLO (ms), shown with the summary.
    """
    from sloserve.bench.plots import (cdfs_figure, figure_svg, itl_timeline_figure,
                                      pareto_figure)
    argv = list(argv if argv is not None else sys.argv)
    parts = [f"<h1>{html.escape(title)}</h1>", "<h2>Summary</h2>", summary_table(results)]
    if slos:
        parts.append("<p>SLO: " + ", ".join(f"{html.escape(k)} &le; {v:g} ms"
                                            for k, v in slos.items()) + "</p>")
    detailed = {k: r for k, r in results.items() if r.get("ttfts") and r.get("chunk_times")}
    charts = []
    if detailed:
        charts.append(_figure(figure_svg(cdfs_figure(detailed)), "TTFT and TPOT CDFs"))
        charts.append(_figure(figure_svg(itl_timeline_figure(detailed)), "ITL timeline"))
    if sweep and sweep.get("rows"):
        charts.append(_figure(figure_svg(pareto_figure(
            sweep["rows"], sweep["fronts"], sweep.get("operating_point"))),
            f"Pareto: throughput against tail latency over {sweep.get('axis', 'the sweep')}"))
    if charts:
        parts += ["<h2>Charts</h2>", *charts]
    elif not detailed:
        parts.append("<p>No per-request data in these results: the CDFs and the ITL timeline "
                     "need a detailed result (--save-detailed).</p>")
    parts += ["<h2>Command</h2>", f"<pre>{html.escape(shlex.join(argv))}</pre>",
              "<h2>Machine</h2>", "<dl>" + "".join(
                  f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>"
                  for k, v in machine().items()) + "</dl>"]
    page = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>'
            f'{html.escape(title)}</title><style>{STYLE}</style></head><body>'
            + "\n".join(parts) + "</body></html>\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
