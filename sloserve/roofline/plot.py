"""``--plot FILE.png``: the log-log roofline chart (matplotlib, Agg backend; imported lazily).

Drawn: the roof ``min(peak, I x bandwidth)`` (bandwidth slope up to the ridge point, then the
compute ceiling), the theoretical points of the analysed workload (prefill and decode at their
arithmetic intensity and attainable FLOP/s) and, with ``--measure``, the engine's measured points
(achieved FLOP/s = theoretical FLOP / measured time, at the same intensity), each labelled.
"""
from __future__ import annotations

from typing import Any, Sequence

from sloserve.roofline.units import fmt_bandwidth, fmt_flops_rate


def plot_roofline(path: str, *, peak: float, bandwidth: float, hardware: str, peak_label: str,
                  theory: Sequence[tuple[str, float, float]] = (),
                  measured: Sequence[tuple[str, float, float]] = (), title: str = "") -> str:
    """Write the chart to ``path`` (PNG). ``theory`` / ``measured``: (label, FLOP/byte, FLOP/s).

    Returns ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ridge = peak / bandwidth
    xs = [i for _, i, _ in (*theory, *measured) if i > 0 and np.isfinite(i)] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    ax.loglog(x, np.minimum(peak, x * bandwidth), color="black", lw=2,
              label=f"roof: {fmt_bandwidth(bandwidth)} x I, ceiling {fmt_flops_rate(peak)} ({peak_label})")
    ax.axvline(ridge, color="grey", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, peak), textcoords="offset points", xytext=(4, -14),
                fontsize=8, color="grey")
    for pts, marker, color, name in ((theory, "o", "tab:blue", "theory (analysed workload, attainable)"),
                                     (measured, "s", "tab:red", "engine measured (achieved)")):
        if not pts:
            continue
        ax.scatter([p[1] for p in pts], [p[2] for p in pts], marker=marker, color=color, zorder=3,
                   label=name)
        for lab, i, f in pts:
            ax.annotate(lab, (i, f), textcoords="offset points", xytext=(5, 4), fontsize=8, color=color)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title or f"roofline: {hardware}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def plot_from_plan(path: str, plan: Any, measurement: Any | None = None) -> str:
    """Chart for a :class:`~sloserve.roofline.report.Plan` and an optional measurement."""
    hw = plan.hardware
    peak = plan.prefill.point.peak
    label = plan.dtype + " peak"
    w_p, w_d = plan.prefill.workload, plan.decode.workload
    theory = [(f"prefill {w_p.batch}x{w_p.seq_len}", plan.prefill.point.intensity, plan.prefill.point.attainable),
              (f"decode B={w_d.batch} ctx {w_d.seq_len}", plan.decode.point.intensity, plan.decode.point.attainable)]
    measured = []
    if measurement is not None:
        measured = [(p.label, p.intensity, p.achieved_flops_per_s) for p in measurement.points]
        if measurement.peak_dtype != plan.dtype:
            label += f"; measured points vs {measurement.peak_dtype}"
    title = f"roofline: {plan.model['name']} on {hw['name']}"
    if measurement is not None:
        title += f" (engine {measurement.engine_dtype}, decode ctx {measurement.context_len})"
    return plot_roofline(path, peak=peak, bandwidth=hw["mem_bandwidth"], hardware=hw["name"],
                         peak_label=label, theory=theory, measured=measured, title=title)
