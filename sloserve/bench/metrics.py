"""Serving metrics from per-request records: TTFT, TPOT, ITL and E2E latency statistics,
throughput and goodput. Pure math (numpy), shared by ``sloserve bench`` and the simulator.

Definitions (also in ``docs/bench.md``), over the successful requests of a run:

* TTFT: first content chunk - send time, one sample per request.
* TPOT: (E2E - TTFT) / (output tokens - 1) per request, output tokens from ``usage``;
  undefined (no sample) when a request has <= 1 output token.
* ITL: gaps between consecutive content chunks, pooled over all requests.
* E2E latency (``e2el``): last content chunk - send time.
* Throughputs: completed requests, output tokens and input + output tokens divided by the
  run's wall time (``duration``: first send to last response).
* Goodput (DistServe, Zhong et al. OSDI'24, section 2): requests per second that meet every
  SLO given (``ttft``, ``tpot``, ``e2el`` in ms; ``sloserve.slo``, the rule the server's SLO
  counters use too); a request with undefined TPOT meets a TPOT SLO; failed requests are never
  good.

Statistics: mean, median, population std and linear-interpolated percentiles (numpy's default,
as vLLM's bench); an empty sample gives 0 for every statistic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from sloserve.slo import missed_slo
from sloserve.workload import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class Stats:
    """Summary of one latency metric, in ms."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    percentiles: list[tuple[float, float]] = field(default_factory=list)
    count: int = 0
    max: float = 0.0

    @classmethod
    def of(cls, samples_s: Sequence[float], percentiles: Sequence[float]) -> "Stats":
        """Statistics of samples given in seconds, reported in ms."""
        if len(samples_s) == 0:
            return cls(percentiles=[(p, 0.0) for p in percentiles])
        a = np.asarray(samples_s, dtype=np.float64) * 1e3
        return cls(mean=float(a.mean()), median=float(np.median(a)), std=float(a.std()),
                   percentiles=[(p, float(np.percentile(a, p))) for p in percentiles],
                   count=int(a.size), max=float(a.max()))

    def p(self, q: float) -> float:
        """The q-th percentile (ms). Raises KeyError if q was not computed."""
        for pq, v in self.percentiles:
            if pq == q:
                return v
        raise KeyError(f"percentile {q} not computed (have {[pq for pq, _ in self.percentiles]})")


@dataclass
class BenchmarkMetrics:
    """Aggregate results of one run (field names as in vLLM's bench where it has them).

    Attributes:
        completed / failed: successful / failed requests.
        total_input / total_output: prompt / output tokens of the successful requests.
        duration: wall time of the run (s).
        request_throughput, request_goodput: req/s; output_throughput, total_token_throughput: tok/s.
        max_output_tokens_per_s: most content chunks in any whole second of the run.
        max_concurrent_requests: most requests in flight during any whole second of the run.
        stats: metric name (ttft, tpot, itl, e2el) -> Stats (ms).
        goodput_slos: the SLOs (ms) goodput was counted under (empty: no goodput).
        num_good: requests meeting every SLO.
        errors: error message -> count, over the failed requests.
    """

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, Stats]
    goodput_slos: dict[str, float]
    num_good: int
    errors: dict[str, int]


def is_good(r: RequestRecord, slos: dict[str, float]) -> bool:
    """True when ``r`` succeeded and meets every SLO in ``slos`` (ms)."""
    return r.success and missed_slo(slos, r.ttft, r.tpot, r.latency) is None


def _per_second_peak(counts: dict[int, int]) -> int:
    return max(counts.values(), default=0)


def peak_output_per_s(records: Sequence[RequestRecord], start: float) -> float:
    """Most content chunks in any whole second of the run (1-s buckets from ``start``), as vLLM's
    "Peak output token throughput" counts them (chunks, not tokens)."""
    counts: dict[int, int] = {}
    for r in records:
        for t in r.chunk_times:
            b = int(t - start)
            counts[b] = counts.get(b, 0) + 1
    return float(_per_second_peak(counts))


def peak_concurrency(records: Sequence[RequestRecord], start: float) -> int:
    """Most requests in flight during any whole second of the run (1-s buckets from ``start``;
    a request counts in every bucket from its send to its last chunk), as vLLM counts it."""
    delta: dict[int, int] = {}  # +1 where a request's first bucket is, -1 after its last
    for r in records:
        end = r.chunk_times[-1] if r.chunk_times else r.send_time
        first, last = int(r.send_time - start), int(end - start)
        delta[first] = delta.get(first, 0) + 1
        delta[last + 1] = delta.get(last + 1, 0) - 1
    peak = level = 0
    for b in sorted(delta):  # a sweep: long runs cost nothing per second
        level += delta[b]
        peak = max(peak, level)
    return peak


def calculate_metrics(records: Sequence[RequestRecord], duration: float,
                      percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                      goodput_slos: dict[str, float] | None = None,
                      start_time: float | None = None) -> BenchmarkMetrics:
    """Aggregate per-request records of one run.

    Args:
        records: one per request, successful or not.
        duration: wall time of the run (s), > 0.
        percentiles: percentiles to report, each in [0, 100].
        goodput_slos: ms limits by metric (see :func:`parse_goodput`); None or {} = no goodput.
        start_time: the run's time 0 (same clock as the records); default: the first send.

    Raises:
        ValueError: duration <= 0, or a percentile outside [0, 100].
    """
    if not duration > 0:
        raise ValueError(f"duration must be > 0 s, got {duration}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be in [0, 100], got {p}")
    start = start_time if start_time is not None else min((r.send_time for r in records), default=0.0)
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    slos = dict(goodput_slos or {})
    num_good = sum(is_good(r, slos) for r in ok) if slos else 0
    return BenchmarkMetrics(
        completed=len(ok), failed=len(failed), total_input=total_in, total_output=total_out,
        duration=duration,
        request_throughput=len(ok) / duration,
        request_goodput=num_good / duration if slos else None,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_output_per_s(ok, start),
        max_concurrent_requests=peak_concurrency(records, start),
        stats={m: Stats.of(samples[m], percentiles) for m in METRICS},
        goodput_slos=slos, num_good=num_good, errors=errors)
