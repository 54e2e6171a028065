"""``sloserve bench sweep``: one benchmark per request rate (or concurrency), the trade-off table,
the Pareto frontier and the operating point.

A sweep point *meets the SLO* when every P99 given is within its limit (``--goodput
ttft:MS tpot:MS e2el:MS`` compared with P99 TTFT, P99 TPOT, P99 E2E latency). The operating point
is the highest rate (or concurrency) that meets it. The Pareto frontier keeps the points no
other point beats on both output throughput (higher) and the tail latency (lower).
"""
from __future__ import annotations

from typing import Any, Sequence


def meets_slo(row: dict[str, Any], slos: dict[str, float]) -> bool:
    """True when the row's P99 of every metric in ``slos`` (ms) is within its limit."""
    return all(row[f"p99_{k}_ms"] <= v for k, v in slos.items())


def operating_point(rows: Sequence[dict[str, Any]], slos: dict[str, float]) -> Any | None:
    """The largest ``point`` among rows that complete without failures and meet the SLO."""
    ok = [r["point"] for r in rows if r["failed"] == 0 and meets_slo(r, slos)]
    return max(ok) if ok else None


def pareto_front(rows: Sequence[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows not dominated in (``key`` lower, output_throughput higher), sorted by ``key``."""
    front = []
    for r in sorted(rows, key=lambda r: (r[key], -r["output_throughput"])):
        if not front or r["output_throughput"] > front[-1]["output_throughput"]:
            front.append(r)
    return front


#: the tail latencies the Pareto plot puts output throughput against
PARETO_KEYS = ("p99_tpot_ms", "p99_ttft_ms")

TABLE_COLUMNS = ("point", "request_throughput", "output_throughput", "mean_ttft_ms",
                 "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "request_goodput",
                 "failed")


def format_table(rows: Sequence[dict[str, Any]], axis: str, slos: dict[str, float]) -> str:
    """Markdown table of the sweep (one row per point; ``meets SLO`` column when SLOs given)."""
    cols = list(TABLE_COLUMNS)
    head = [axis if c == "point" else c for c in cols] + (["meets SLO"] if slos else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v)))
        if slos:
            cells.append("yes" if meets_slo(r, slos) and r["failed"] == 0 else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_sweep(rows: Sequence[dict[str, Any]], axis: str, slos: dict[str, float], result_dir: str,
                title: str) -> dict[str, Any]:
    """Print and save a finished sweep: ``sweep.md`` (the table), ``sweep.json`` (rows, SLOs,
    operating point) and ``pareto.png`` under ``result_dir``. Returns ``{"axis", "rows"
    (those plotted), "fronts", "operating_point"}`` (what the HTML report draws)."""
    import os

    from sloserve.bench.plots import plot_pareto
    from sloserve.bench.results import save_json
    op = operating_point(rows, slos) if slos else None
    table = format_table(rows, axis, slos)
    print(table)
    if slos:
        if op is None:
            print("operating point: no point meets the SLO")
        else:
            top = (" (the highest point swept: the capacity may be higher)"
                   if op == max(r["point"] for r in rows) else "")
            print(f"operating point: {axis} = {op:g}{top}")
    with open(os.path.join(result_dir, "sweep.md"), "w") as f:
        f.write(table + "\n")
    finite = lambda v: "inf" if v == float("inf") else v  # noqa: E731  (strict JSON, as vLLM)
    save_json({"axis": axis, "slos": slos, "operating_point": finite(op),
               "rows": [{**r, "point": finite(r["point"])} for r in rows]},
              os.path.join(result_dir, "sweep.json"))
    plotted = [r for r in rows if r["completed"] > 0]  # an all-failed point has no latencies
    fronts = {k: pareto_front(plotted, k) for k in PARETO_KEYS}
    png = plot_pareto(plotted, os.path.join(result_dir, "pareto.png"), fronts, op, title=title)
    print(f"table: {os.path.join(result_dir, 'sweep.md')}; plot: {png}")
    return {"axis": axis, "rows": plotted, "fronts": fronts, "operating_point": op}
