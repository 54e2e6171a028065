"""``GET /stats`` (on ``serve`` and on ``router``): the exporter's figures as one JSON snapshot,
and the ``GET /dashboard`` page over it (``templates/dashboard.html``).

``cumulative``: every counter, gauge and histogram sum / count of the Prometheus registry (the
very samples ``/metrics`` renders; buckets left out), keyed by metric name, labels other than
``model_name`` as ``name=value`` keys; taken under the exporter's record lock, so a snapshot
and a scrape with the same ``seq`` (``sloserve:stats_sequence`` in ``/metrics``) agree.

``window``: the requests that finished in the last ``seconds`` (60), apart from the cumulative
figures: their count, SLO met / missed, attainment, goodput (met requests per second of the
window) and P50 / P90 / P99 of TTFT, TPOT and E2E latency (per request) and ITL (per token), in
ms, linear-interpolated as ``sloserve bench`` reports them.
"""
from __future__ import annotations

import collections
import math
from importlib.resources import files
from typing import Any

from prometheus_client import CollectorRegistry

#: the dashboard page (package data): one HTML file, no outside script, style or font
DASHBOARD_HTML = files("sloserve").joinpath("templates/dashboard.html").read_bytes()
WINDOW_S = 60.0
PERCENTILES = (50.0, 90.0, 99.0)
#: ITL samples kept at most (16 streams at 100 tokens/s for 60 s is ~100k)
MAX_ITLS = 200_000


def percentile(sorted_xs: list[float], p: float) -> float:
    """numpy's default (linear) percentile of an ascending, non-empty list."""
    k = (len(sorted_xs) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(x * 1e3 for x in xs)
    return {f"p{p:g}": percentile(xs, p) for p in PERCENTILES}


class LatencyWindow:
    """The latencies of the requests (and tokens) recorded in the last ``seconds``; times are
    the caller's clock (monotonic seconds), given with each call."""

    def __init__(self, seconds: float = WINDOW_S):
        self.seconds = seconds
        self._requests: collections.deque = collections.deque()  # (t, ttft, tpot, e2el, miss)
        self._itls: collections.deque = collections.deque(maxlen=MAX_ITLS)  # (t, itl)
        self._start: float | None = None

    def _trim(self, now: float) -> None:
        cut = now - self.seconds
        while self._requests and self._requests[0][0] < cut:
            self._requests.popleft()
        while self._itls and self._itls[0][0] < cut:
            self._itls.popleft()

    def start(self, now: float) -> None:
        if self._start is None:
            self._start = now

    def add_request(self, now: float, ttft: float | None, tpot: float | None, e2el: float,
                    missed: str | None) -> None:
        """A finished request (``missed``: the SLO metric it missed, "" when met, None when no
        SLO is set)."""
        self.start(now)
        self._requests.append((now, ttft, tpot, e2el, missed))
        self._trim(now)

    def add_itls(self, now: float, itls) -> None:
        self.start(now)
        self._itls.extend((now, x) for x in itls)

    def summary(self, now: float) -> dict[str, Any]:
        self._trim(now)
        reqs = list(self._requests)
        span = min(self.seconds, now - self._start) if self._start is not None else 0.0
        out: dict[str, Any] = {"seconds": self.seconds, "span_s": span, "requests": len(reqs)}
        judged = [r[4] for r in reqs if r[4] is not None]
        if judged:
            met = sum(1 for m in judged if m == "")
            out.update(slo_met=met, slo_missed=len(judged) - met, attainment=met / len(judged),
                       goodput_rps=met / span if span > 0 else None)
        out["ttft_ms"] = _summary([r[1] for r in reqs if r[1] is not None])
        out["tpot_ms"] = _summary([r[2] for r in reqs if r[2] is not None])
        out["e2el_ms"] = _summary([r[3] for r in reqs])
        out["itl_ms"] = _summary([x for _, x in self._itls])
        return out


def registry_values(registry: CollectorRegistry) -> dict[str, Any]:
    """The registry's samples as ``/stats`` reports them (see the module docstring)."""
    out: dict[str, Any] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            if not labels:
                out[s.name] = s.value
            else:
                key = (next(iter(labels.values())) if len(labels) == 1
                       else ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
                out.setdefault(s.name, {})[key] = s.value
    return out


#: gauges that a sum over servers does not mean: averaged, or their largest kept
_MEAN = frozenset({"vllm:kv_cache_usage_perc"})
_MAX = frozenset({"sloserve:kv_cache_usage_peak_perc"})


def merge_values(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Several servers' ``cumulative`` values as one (the router's ``/stats``): counters,
    gauges and histogram sums / counts added up, by label too; KV cache use averaged, its
    peak the largest."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(k for s in snapshots for k in s):
        vals = [s[name] for s in snapshots if name in s]
        if all(isinstance(v, dict) for v in vals):
            out[name] = merge_values(vals)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[name] = (sum(vals) / len(vals) if name in _MEAN
                         else max(vals) if name in _MAX else sum(vals))
    return out
