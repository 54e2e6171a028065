"""The metric flags of ``sloserve bench`` and ``sloserve sim`` (vLLM's spelling): which latency
metrics get statistics (``--percentile-metrics``) and which percentiles (``--metric-percentiles``)."""
from __future__ import annotations

import argparse

from sloserve.bench.metrics import DEFAULT_PERCENTILES, METRICS


def _floats(v: str) -> list[float]:
    try:
        return [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {v!r}") from None


def add_metric_args(g) -> None:
    """Add both flags to a parser or argument group."""
    g.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help="metrics whose statistics are printed and written to the JSON "
                        f"(of {','.join(METRICS)})")
    g.add_argument("--metric-percentiles", type=_floats, default=list(DEFAULT_PERCENTILES),
                   help="percentiles of each metric, e.g. 50,90,99")


def shown_metrics(a: argparse.Namespace) -> tuple[str, ...]:
    """--percentile-metrics as a tuple. Raises ValueError for unknown names."""
    shown = tuple(m.strip() for m in a.percentile_metrics.split(",") if m.strip())
    bad = [m for m in shown if m not in METRICS]
    if bad or not shown:
        raise ValueError(f"--percentile-metrics: unknown {bad or a.percentile_metrics!r}; "
                         f"choose from {','.join(METRICS)}")
    return shown


def check_metric_flags(a: argparse.Namespace) -> tuple[str, ...]:
    """Validate both flags; returns the metrics shown. Raises ValueError."""
    bad = [p for p in a.metric_percentiles if not 0 <= p <= 100]
    if bad or not a.metric_percentiles:
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got "
                         f"{a.metric_percentiles}")
    return shown_metrics(a)
