"""Prometheus exporter: a StatLogger that turns engine records into vLLM-named metrics.

Every metric carries the label ``model_name``; ``vllm:request_success`` also ``finished_reason``.
Metric names, types and histogram buckets follow vLLM (v1) so existing Grafana dashboards work:

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (fraction 0..1);
* counters ``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success``, ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (tokens;
  exported with the ``_total`` suffix);
* histograms (seconds) ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``,
  ``vllm:request_queue_time_seconds``, ``vllm:request_prefill_time_seconds``,
  ``vllm:request_decode_time_seconds``; (tokens) ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``;
* speculative decoding, vLLM's counters: ``vllm:spec_decode_num_drafts``,
  ``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens``,
  ``vllm:spec_decode_num_accepted_tokens_per_pos`` (label ``position``, from 0: drafts whose
  tokens were accepted up to that position);
* sloserve's own: counters ``sloserve:engine_steps``, ``sloserve:requests_rejected`` (HTTP
  429s), histogram ``sloserve:batched_tokens_per_step`` (tokens), gauges
  ``sloserve:kv_cache_usage_peak_perc`` (fraction 0..1), ``sloserve:grammar_compiles``
  (structured-output grammars compiling or waiting to);
* SLO (``serve --goodput ttft:MS tpot:MS [e2el:MS]``, ``sloserve.slo``'s rule, decided as
  each request finishes, aborted requests left out): counters ``sloserve:requests_slo_met``
  and ``sloserve:requests_slo_missed`` (label ``reason``: the first of ttft, tpot, e2el
  missed, so the reasons add up to the requests missed); the latency histograms keep vLLM's
  edges and add each limit as an edge, and ITL / TPOT edges below 10 ms (1, 2.5, 5, 7.5 ms);
* ``sloserve:stats_sequence``: the records taken so far (``GET /stats`` carries the same number:
  a snapshot and a scrape with one sequence show the same counters);
* prefill/decode disaggregation (zero without a KV connector): counters
  ``sloserve:kv_transfer_bytes`` (label ``direction``: ``sent`` / ``received``; KV payload
  bytes) and ``sloserve:kv_transfer_failures``, advanced to the core's totals at scrape time;
  gauge ``sloserve:num_requests_waiting_for_kv`` (requests holding blocks while their KV
  arrives or goes); histogram ``sloserve:kv_transfer_seconds`` (a decode request's wait from
  admission until its KV and first token had arrived).

Each instance owns its ``CollectorRegistry`` (several apps may live in one process).
``record`` is called from the engine thread; prometheus_client metrics are thread-safe.
"""
from __future__ import annotations

import collections
import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from sloserve.engine.metrics import FinishedRequestStats, IterationStats
from sloserve.stats import LatencyWindow, registry_values
from sloserve.slo import SLO_METRICS, missed_slo

__all__ = ["PrometheusStatLogger", "build_1_2_5_buckets", "CONTENT_TYPE_LATEST"]

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")
#: steps kept for the dashboard's step timeline
MAX_STEPS = 600
#: ITL / TPOT edges below vLLM's lowest (10 ms): decode steps here take 4-15 ms
FINE_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075]


def with_edges(buckets: list[float], *edges: float | None) -> list[float]:
    """``buckets`` with ``edges`` (seconds; None skipped) added, sorted, no duplicates."""
    return sorted(set(buckets) | {e for e in edges if e is not None})


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ...: every such value <= max_value.

    vLLM's bucket scheme for token-count histograms, e.g. ``build_1_2_5_buckets(100)`` ->
    ``[1, 2, 5, 10, 20, 50, 100]``.
    """
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10 ** exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


class PrometheusStatLogger:
    """StatLogger (``record(it, finished)``) exporting vLLM-named Prometheus metrics.

    The model name and max_model_len are usually known only after the engine loaded the model, so
    the metrics are created by :meth:`bind` (called by ``build_app``); records arriving earlier bind
    with the constructor's values.

    Args:
        model_name: value of the ``model_name`` label (None: set later by bind).
        max_model_len: largest token-count bucket (tokens; None: set later by bind, default 8192).
        max_num_batched_tokens: largest ``sloserve:batched_tokens_per_step`` bucket (tokens).
        registry: where to register (default: a new private ``CollectorRegistry``).
        slos: the per-request SLO limits in ms (``sloserve.slo.parse_goodput``; None or {}:
            no SLO counters).
    """

    def __init__(self, model_name: str | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 registry: CollectorRegistry | None = None, num_speculative_tokens: int = 0,
                 slos: dict[str, float] | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.slos = dict(slos or {})
        #: records taken (steps and front-end aborts): the snapshot's sequence number
        self.seq = 0
        self.window = LatencyWindow()
        #: the latest steps for the dashboard's timeline: (index, time, prefill tokens,
        #: decode tokens, step s, running, waiting, roofline s or None)
        self.steps: collections.deque = collections.deque(maxlen=MAX_STEPS)
        self._num_steps = 0
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        #: with speculative decoding, the per-position series exist from the start (as vLLM)
        self.num_speculative_tokens = num_speculative_tokens
        self._bound = False
        self._lock = threading.Lock()
        # a scrape sees whole steps: record and render take turns (counters of one step agree)
        self._record_lock = threading.Lock()
        self._peak_kv = 0.0
        #: the served model's step roofline (``set_roofline``; None: no bound drawn)
        self.roofline = None

    # --------------------------------------------------------------------------------- setup
    def bind(self, model_name: str | None = None, max_model_len: int | None = None,
             max_num_batched_tokens: int | None = None) -> None:
        """Create the metrics (once) with these label / bucket settings; later calls are no-ops."""
        with self._lock:
            if self._bound:
                return
            self.model_name = model_name or self.model_name or "unknown"
            self.max_model_len = max_model_len or self.max_model_len or 8192
            self.max_num_batched_tokens = (max_num_batched_tokens or self.max_num_batched_tokens
                                           or self.max_model_len)
            self._create()
            self._bound = True

    def _create(self) -> None:
        r, name = self.registry, self.model_name
        lbl = ["model_name"]

        def gauge(n, doc):
            return Gauge(n, doc, lbl, registry=r, multiprocess_mode="mostrecent").labels(name)

        def counter(n, doc):
            return Counter(n, doc, lbl, registry=r).labels(name)

        def hist(n, doc, buckets):
            return Histogram(n, doc, lbl, buckets=buckets, registry=r).labels(name)

        token_buckets = build_1_2_5_buckets(self.max_model_len)
        limit = {k: v / 1e3 for k, v in self.slos.items()}  # seconds
        itl_buckets = with_edges(FINE_ITL_BUCKETS + ITL_BUCKETS, limit.get("tpot"))
        self.g_running = gauge("vllm:num_requests_running",
                               "Number of requests in model execution batches.")
        self.g_waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.g_kv_usage = gauge("vllm:kv_cache_usage_perc",
                                "KV-cache usage. 1 means 100 percent usage.")
        self.c_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.c_prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.c_generation_tokens = counter("vllm:generation_tokens",
                                           "Number of generation tokens processed.")
        self._request_success = Counter("vllm:request_success",
                                        "Count of successfully processed requests.",
                                        ["model_name", "finished_reason"], registry=r)
        self.c_request_success = {fr: self._request_success.labels(name, fr) for fr in FINISH_REASONS}
        self.h_ttft = hist("vllm:time_to_first_token_seconds",
                           "Histogram of time to first token in seconds.",
                           with_edges(TTFT_BUCKETS, limit.get("ttft")))
        self.h_itl = hist("vllm:inter_token_latency_seconds",
                          "Histogram of inter-token latency in seconds.", itl_buckets)
        self.h_tpot = hist("vllm:request_time_per_output_token_seconds",
                           "Histogram of time_per_output_token_seconds per request.", itl_buckets)
        self.h_e2e = hist("vllm:e2e_request_latency_seconds",
                          "Histogram of e2e request latency in seconds.",
                          with_edges(REQUEST_LATENCY_BUCKETS, limit.get("e2el")))
        self.h_queue = hist("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.h_prefill = hist("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.h_decode = hist("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.",
                             REQUEST_LATENCY_BUCKETS)
        self.h_prompt_tokens = hist("vllm:request_prompt_tokens",
                                    "Number of prefill tokens processed.", token_buckets)
        self.h_generation_tokens = hist("vllm:request_generation_tokens",
                                        "Number of generation tokens processed.", token_buckets)
        self.c_steps = counter("sloserve:engine_steps", "Number of engine steps (model forwards).")
        self.c_prefix_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.c_prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self._prefix_seen = (0, 0)
        self.c_rejected = counter("sloserve:requests_rejected",
                                  "Requests refused by overload control (HTTP 429).")
        self.h_batched_tokens = hist("sloserve:batched_tokens_per_step",
                                     "Tokens in the forward pass per engine step.",
                                     build_1_2_5_buckets(max(self.max_num_batched_tokens, 1)))
        self.g_kv_peak = gauge("sloserve:kv_cache_usage_peak_perc",
                               "Peak KV-cache usage since start. 1 means 100 percent usage.")
        self.c_spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.c_spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                           "Number of draft tokens.")
        self.c_spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                       "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.",
                                     ["model_name", "position"], registry=r)
        for pos in range(self.num_speculative_tokens):
            self._spec_per_pos.labels(name, str(pos))
        self.g_grammar_compiles = gauge(
            "sloserve:grammar_compiles",
            "Structured-output grammars compiling or waiting to compile.")
        self._kv_transfer_bytes = Counter("sloserve:kv_transfer_bytes",
                                          "KV payload bytes the KV connector sent / received.",
                                          ["model_name", "direction"], registry=r)
        self.c_kv_bytes = {d: self._kv_transfer_bytes.labels(name, d)
                           for d in ("sent", "received")}
        self.c_kv_failures = counter("sloserve:kv_transfer_failures",
                                     "KV transfers that failed or timed out.")
        self._kv_seen = (0, 0, 0)
        self.g_waiting_for_kv = gauge(
            "sloserve:num_requests_waiting_for_kv",
            "Requests holding KV blocks while their KV is transferred.")
        self.c_slo_met = counter("sloserve:requests_slo_met",
                                 "Finished requests within every --goodput limit.")
        self._slo_missed = Counter("sloserve:requests_slo_missed",
                                   "Finished requests over a --goodput limit, by the first "
                                   "limit missed (ttft, tpot, e2el).",
                                   ["model_name", "reason"], registry=r)
        self.c_slo_missed = {m: self._slo_missed.labels(name, m) for m in SLO_METRICS
                             if m in self.slos}
        self.g_seq = gauge("sloserve:stats_sequence",
                           "Records taken by the exporter (GET /stats carries the same number).")
        self.h_kv_transfer = hist("sloserve:kv_transfer_seconds",
                                  "Histogram of a decode request's wait for its KV transfer "
                                  "in seconds.", TTFT_BUCKETS)

    # ------------------------------------------------------------------------------ recording
    def record(self, it: IterationStats | None, finished: list[FinishedRequestStats]) -> None:
        """Record one engine step and the requests that finished in it (``it`` None: requests
        the front end aborted, counted at once)."""
        if not self._bound:
            self.bind()
        now = time.monotonic()
        with self._record_lock:
            if it is not None:
                self._record_step(it)
                self.window.add_itls(now, it.itls)
                self._num_steps += 1
                roof = self.roofline
                bound = (roof.observe(it.num_batched_tokens, it.num_sequences,
                                      it.num_attention_pairs, it.num_kv_tokens_read, it.step_s)
                         if roof is not None and it.num_sequences else None)
                self.steps.append((self._num_steps, now, it.num_prompt_tokens,
                                   it.num_batched_tokens - it.num_prompt_tokens, it.step_s,
                                   it.num_running, it.num_waiting, bound))
            for f in finished:
                self._record_finished(f, now)
            self.seq += 1
            self.g_seq.set(self.seq)

    def _record_step(self, it: IterationStats) -> None:
        self.g_running.set(it.num_running)
        self.g_waiting.set(it.num_waiting)
        self.set_kv_usage(it.kv_cache_usage)
        if it.num_preemptions:
            self.c_preemptions.inc(it.num_preemptions)
        if it.num_prompt_tokens:
            self.c_prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.c_generation_tokens.inc(it.num_generation_tokens)
        self.c_steps.inc()
        self.h_batched_tokens.observe(it.num_batched_tokens)
        sd = it.spec_decoding
        if sd is not None:
            self.c_spec_drafts.inc(sd.num_drafts)
            self.c_spec_draft_tokens.inc(sd.num_draft_tokens)
            self.c_spec_accepted.inc(sd.num_accepted_tokens)
            for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
                self._spec_per_pos.labels(self.model_name, str(pos)).inc(n)
        for t in it.ttfts:
            self.h_ttft.observe(t)
        for t in it.kv_transfer_s:
            self.h_kv_transfer.observe(t)
        for t in it.itls:
            self.h_itl.observe(t)

    def _record_finished(self, f: FinishedRequestStats, now: float) -> None:
        reason = f.finish_reason or "abort"
        missed = None
        if reason != "abort" and f.ttft is not None:
            if self.slos:
                missed = missed_slo(self.slos, f.ttft, f.tpot, f.e2e_latency) or ""
                if missed:
                    self.c_slo_missed[missed].inc()
                else:
                    self.c_slo_met.inc()
            self.window.add_request(now, f.ttft, f.tpot, f.e2e_latency, missed)
        if reason not in self.c_request_success:
            self.c_request_success[reason] = self._request_success.labels(self.model_name, reason)
        self.c_request_success[reason].inc()
        self.h_e2e.observe(f.e2e_latency)
        if f.queue_time is not None:
            self.h_queue.observe(f.queue_time)
        self.h_prompt_tokens.observe(f.num_prompt_tokens)
        self.h_generation_tokens.observe(f.num_generation_tokens)
        if f.tpot is not None:
            self.h_tpot.observe(f.tpot)
        if f.prefill_time is not None:
            self.h_prefill.observe(f.prefill_time)
        if f.decode_time is not None:
            self.h_decode.observe(f.decode_time)

    def set_kv_usage(self, usage: float) -> None:
        """Set the KV usage gauge (fraction 0..1) and raise the peak gauge if needed."""
        if not self._bound:
            self.bind()
        self.g_kv_usage.set(usage)
        if usage > self._peak_kv:
            self._peak_kv = usage
            self.g_kv_peak.set(usage)

    def set_queue_sizes(self, num_running: int, num_waiting: int) -> None:
        """Refresh the running / waiting gauges (e.g. at scrape time, after aborts)."""
        if not self._bound:
            self.bind()
        self.g_running.set(num_running)
        self.g_waiting.set(num_waiting)

    def set_grammar_compiles(self, n: int) -> None:
        """Refresh the gauge of grammars compiling (at scrape time)."""
        if not self._bound:
            self.bind()
        self.g_grammar_compiles.set(n)

    def count_rejection(self) -> None:
        if not self._bound:
            self.bind()
        self.c_rejected.inc()

    def set_prefix_cache_totals(self, queries: int, hits: int) -> None:
        """Advance the prefix-cache counters to the core's totals (tokens since its start)."""
        if not self._bound:
            self.bind()
        q0, h0 = self._prefix_seen
        if queries >= q0 and hits >= h0:
            self.c_prefix_queries.inc(queries - q0)
            self.c_prefix_hits.inc(hits - h0)
        self._prefix_seen = (queries, hits)

    def set_kv_transfer(self, num_waiting_for_kv: int, bytes_sent: int, bytes_received: int,
                        failures: int) -> None:
        """Refresh the gauge of requests waiting for KV and advance the KV-transfer counters to
        the core's totals (since its start; totals below the last ones seen, a new core, only
        become the new base)."""
        if not self._bound:
            self.bind()
        self.g_waiting_for_kv.set(num_waiting_for_kv)
        now = (bytes_sent, bytes_received, failures)
        if all(n >= seen for n, seen in zip(now, self._kv_seen)):
            sent0, received0, failures0 = self._kv_seen
            self.c_kv_bytes["sent"].inc(bytes_sent - sent0)
            self.c_kv_bytes["received"].inc(bytes_received - received0)
            self.c_kv_failures.inc(failures - failures0)
        self._kv_seen = now

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (content type CONTENT_TYPE_LATEST)."""
        if not self._bound:
            self.bind()
        with self._record_lock:
            return generate_latest(self.registry)

    def snapshot(self, steps_after: int | None = None) -> dict:
        """``GET /stats`` (``sloserve.stats``): the sequence number, the registry's
        values and the last minute's finished requests, taken together; with ``steps_after``
        also the kept steps whose index is above it (``"steps"``: index, seconds before the
        snapshot, prefill tokens, decode tokens, step seconds, running, waiting, the step's
        roofline bound in seconds or None) and ``"roofline"`` (what the bound assumes: peak
        TFLOP/s and bandwidth GB/s, each the measured one or the best a step reached if
        higher, weight MB a step reads, the measurement; None: no bound)."""
        if not self._bound:
            self.bind()
        with self._record_lock:
            now = time.monotonic()
            out = {"object": "stats", "seq": self.seq, "time": time.time(),
                   "model": self.model_name, "slo_ms": self.slos,
                   "cumulative": registry_values(self.registry),
                   "window": self.window.summary(now)}
            if steps_after is not None:
                out["steps"] = [[i, round(now - t, 4), p, d, s, r, w, b]
                                for i, t, p, d, s, r, w, b in self.steps if i > steps_after]
                roof = self.roofline
                out["roofline"] = None if roof is None else {
                    "peak_tflops": roof.peak / 1e12, "bandwidth_gbs": roof.bandwidth / 1e9,
                    "measured_peak_tflops": roof.measured[0] / 1e12,
                    "measured_bandwidth_gbs": roof.measured[1] / 1e9,
                    "weight_mb": roof.per["weights"] / 1e6, "source": roof.hw.source}
            return out
