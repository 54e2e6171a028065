"""PNG plots of benchmark results (matplotlib, Agg backend), drawn from result JSON dicts saved
with ``--save-detailed`` so they work on files from any run, real or simulated.

* CDFs of per-request TTFT and TPOT (one line per run when comparing runs);
* ITL over wall time: every inter-token gap at the time its chunk arrived, with the arrivals of
  ``long`` requests (the ``mixed`` workload) as vertical lines: an unchunked long prefill shows
  up as a column of tall gaps right after its arrival;
* the sweep's Pareto frontier (see :mod:`sloserve.bench.sweep`).

Each ``plot_*`` writes a PNG; its ``*_figure`` twin returns the figure, which
:func:`figure_svg` turns into inline SVG for the HTML report (``sloserve.bench.report``).
"""
from __future__ import annotations

import io
import os
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sloserve.latency import tpot as request_tpot  # noqa: E402


def per_request_ms(result: dict[str, Any]) -> tuple[list[float], list[float]]:
    """(TTFTs, TPOTs) in ms of the successful requests of a detailed result."""
    ttft, tpot = [], []
    for i, err in enumerate(result["errors"]):
        if err:
            continue
        ttft.append(result["ttfts"][i] * 1e3)
        n, ct = result["output_lens"][i], result["chunk_times"][i]
        t = request_tpot(ct[-1] - result["start_times"][i], result["ttfts"][i], n) if ct else None
        if t is not None:
            tpot.append(t * 1e3)
    return ttft, tpot


def _cdf(ax, values: Sequence[float], label: str) -> None:
    v = np.sort(np.asarray(values))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)


def plot_cdfs(results: dict[str, dict[str, Any]], path: str, title: str = "") -> str:
    """CDFs of TTFT and TPOT, one line per labelled result. Returns ``path``."""
    return _save(cdfs_figure(results, title), path)


def cdfs_figure(results: dict[str, dict[str, Any]], title: str = ""):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in results.items():
        ttft, tpot = per_request_ms(r)
        _cdf(axes[0], ttft, label)
        _cdf(axes[1], tpot, label)
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title or "per-request latency CDFs")
    return fig


def plot_itl_timeline(results: dict[str, dict[str, Any]], path: str, title: str = "") -> str:
    """ITL over wall time, one panel per labelled result, long-prompt arrivals marked."""
    return _save(itl_timeline_figure(results, title), path)


def itl_timeline_figure(results: dict[str, dict[str, Any]], title: str = ""):
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.8 * len(results)), squeeze=False,
                             sharex=True)
    for ax, (label, r) in zip(axes[:, 0], results.items()):
        t0 = min(r["start_times"], default=0.0)  # perf_counter clock -> s since the start
        xs, ys = [], []
        for ct in r["chunk_times"]:
            xs += [t - t0 for t in ct[1:]]
            ys += [(b - a) * 1e3 for a, b in zip(ct, ct[1:])]
        ax.scatter(xs, ys, s=4, alpha=0.6)
        for t, tag, err in zip(r["start_times"], r.get("tags") or [], r["errors"]):
            if tag == "long" and not err:  # served long prompts (not those the server refused)
                ax.axvline(t - t0, color="red", alpha=0.35, lw=1)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{label}: inter-token gaps (red: long-prompt arrivals)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("wall time since the run's start (s)")
    if title:
        fig.suptitle(title)
    return fig


def plot_pareto(rows: list[dict[str, Any]], path: str, fronts: dict[str, list[dict[str, Any]]],
                operating_point: float | None = None, title: str = "") -> str:
    """Output throughput against each key of ``fronts`` (a latency column); points labelled by
    rate/concurrency, the Pareto-optimal points of ``fronts[key]`` joined, the operating point
    circled. Returns ``path``."""
    return _save(pareto_figure(rows, fronts, operating_point, title), path)


def pareto_figure(rows: list[dict[str, Any]], fronts: dict[str, list[dict[str, Any]]],
                  operating_point: float | None = None, title: str = ""):
    x_keys = list(fronts)
    fig, axes = plt.subplots(1, len(x_keys), figsize=(5.5 * len(x_keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], x_keys):
        xs = [r[key] for r in rows]
        ys = [r["output_throughput"] for r in rows]
        ax.scatter(xs, ys, color="tab:blue")
        for r, x, y in zip(rows, xs, ys):
            ax.annotate(str(r["point"]), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        front = fronts[key]
        ax.plot([r[key] for r in front], [r["output_throughput"] for r in front], "-",
                color="tab:orange", label="Pareto frontier")
        for r in rows:
            if operating_point is not None and r["point"] == operating_point:
                ax.scatter([r[key]], [r["output_throughput"]], s=160, facecolors="none",
                           edgecolors="green", linewidths=2, label="operating point")
        ax.set_xlabel(key.replace("_", " ").replace(" ms", " (ms)"))
        ax.set_ylabel("output throughput (tok/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "throughput vs tail latency")
    return fig


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure_svg(fig) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog, no outside reference)."""
    buf = io.StringIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None, "Format": None,
                                            "Type": None})  # no RDF block
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]
