"""One benchmark run: send a workload's requests on an arrival schedule, collect records.

The run is ``asyncio`` over one ``httpx.AsyncClient``. Request i is sent at its arrival time
(from the arrival process, or the trace's own times); with ``max_concurrency`` a request that
arrives while that many are in flight waits client-side, and its send time (hence TTFT) starts
when it is actually sent, as in ``vllm bench serve``.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sloserve.bench.arrivals import arrival_times
from sloserve.bench.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, calculate_metrics
from sloserve.bench.request_func import RequestInput, send_request
from sloserve.workload import RequestRecord, SampleRequest

ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}


@dataclass
class BenchConfig:
    """Settings of one run (flag names as in ``vllm bench serve``).

    Attributes:
        base_url: server root, e.g. ``http://127.0.0.1:8000``.
        endpoint: ``/v1/completions`` or ``/v1/chat/completions``.
        model: the ``model`` field sent.
        request_rate: mean req/s (``inf``: all at once).
        burstiness: gamma shape of the gaps (1 = Poisson).
        arrival: ``poisson``, ``gamma`` or ``constant``.
        max_concurrency: most requests in flight (None: unlimited).
        seed: seeds the arrival times.
        ignore_eos: send ``ignore_eos`` so outputs run to ``max_tokens``.
        ignore_priority: send no request's ``priority`` (a trace's), e.g. to a fcfs server,
            which refuses one.
        percentiles: reported percentiles.
        goodput: SLOs in ms by metric.
        extra_body: more JSON fields per request.
        initial_test: send the shortest prompt once (2 tokens) before the run and stop with
            its error if it fails.
        progress: show a progress bar.
        timeout_s: the longest wait for the next bytes of a response (s; httpx read timeout);
            a server that stalls longer fails the request instead of hanging the run.
    """

    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = float("inf")
    burstiness: float = 1.0
    arrival: str = "poisson"
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    ignore_priority: bool = False
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    goodput: dict[str, float] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    initial_test: bool = True
    progress: bool = True
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def url(self) -> str:
        """Full endpoint URL."""
        return self.base_url.rstrip("/") + self.endpoint


@dataclass
class BenchmarkRun:
    """A finished run.

    Attributes:
        config: its settings.
        requests: the workload, in send order.
        records: one per request, same order; times are ``time.perf_counter`` seconds.
        start_time: perf_counter when the first request was due (time 0 of the plots).
        duration: start to the last response (s).
        metrics: aggregates.
    """

    config: BenchConfig
    requests: list[SampleRequest]
    records: list[RequestRecord]
    start_time: float
    duration: float
    metrics: BenchmarkMetrics


class BenchmarkError(RuntimeError):
    """The run could not start (the initial test request failed)."""


def _inputs(cfg: BenchConfig, reqs: list[SampleRequest]) -> list[RequestInput]:
    chat = ENDPOINTS[cfg.endpoint]
    return [RequestInput(url=cfg.url, model=cfg.model, prompt=r.prompt, prompt_len=r.prompt_len,
                         max_tokens=r.expected_output_len, chat=chat, ignore_eos=cfg.ignore_eos,
                         extra_body=({**cfg.extra_body, "priority": r.priority}
                                     if r.priority and not cfg.ignore_priority
                                     else cfg.extra_body), tag=r.tag) for r in reqs]


async def run_benchmark_async(cfg: BenchConfig, requests: list[SampleRequest],
                              count_tokens: Callable[[str], int] | None = None) -> BenchmarkRun:
    """Run the workload against the server; see the module docstring.

    Raises:
        BenchmarkError: the initial test request failed (message: the server's error).
        ValueError: an empty workload.
    """
    if not requests:
        raise ValueError("the workload has no requests")
    if any(r.arrival_time is not None for r in requests):
        offsets = [r.arrival_time or 0.0 for r in requests]
    else:
        offsets = list(arrival_times(len(requests), cfg.request_rate, process=cfg.arrival,
                                     burstiness=cfg.burstiness, seed=cfg.seed))
    inputs = _inputs(cfg, requests)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    async with httpx.AsyncClient(timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        if cfg.initial_test:
            shortest = min(inputs, key=lambda i: i.prompt_len)
            test = replace(shortest, max_tokens=2)
            rec = await send_request(client, test, count_tokens)
            if not rec.success:
                raise BenchmarkError(f"initial test request to {cfg.url} failed: {rec.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), disable=not cfg.progress, transient=False)
        task = progress.add_task("requests", total=len(inputs))

        async def one(inp: RequestInput, due: float) -> RequestRecord:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await send_request(client, inp, count_tokens)
            else:
                waited = time.perf_counter()
                async with sem:
                    waited = time.perf_counter() - waited
                    rec = await send_request(client, inp, count_tokens)
                rec.queue_time = waited
            progress.advance(task)
            return rec

        with progress:
            start = time.perf_counter()
            records = await asyncio.gather(*(one(i, start + t) for i, t in zip(inputs, offsets)))
            duration = time.perf_counter() - start
    metrics = calculate_metrics(records, duration, cfg.percentiles, cfg.goodput, start)
    return BenchmarkRun(cfg, requests, list(records), start, duration, metrics)


def run_benchmark(cfg: BenchConfig, requests: list[SampleRequest],
                  count_tokens: Callable[[str], int] | None = None) -> BenchmarkRun:
    """Synchronous wrapper of :func:`run_benchmark_async`."""
    return asyncio.run(run_benchmark_async(cfg, requests, count_tokens))
