"""Serving statistics: per-step and per-finished-request records, and a running summary.

The front end's output processor builds these records from what the engine core publishes
(its step stats) and from when outputs arrive (TTFT, ITL); loggers consume them (the server's
Prometheus exporter, the demo's summary). The step trace is written by the engine core itself.
Nothing here knows HTTP or Prometheus.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class IterationStats:
    """One engine step. Times in seconds.

    Attributes:
        num_running, num_waiting: queue sizes after the step.
        kv_cache_usage: fraction of KV blocks in use after scheduling, in [0, 1].
        num_prompt_tokens: prefill tokens computed this step (recomputation included).
        num_generation_tokens: tokens sampled this step.
        num_batched_tokens: tokens in the forward pass.
        num_preemptions: requests preempted this step.
        ttfts: time to first token of requests that got their first token this step.
        itls: inter-token latencies of the decode tokens sampled this step.
        step_s: wall time of the step; forward_s: of the model forward alone.
        start_time: ``time.monotonic()`` when the step was scheduled (s).
        spec_decoding: the step's draft counts (None: no request had drafts).
        kv_transfer_s: KV-transfer times of the decode requests whose KV and first token
            arrived (``EngineCoreOutput.kv_transfer_s``) with this step or the messages
            without a step before it.
        num_sequences, num_attention_pairs, num_kv_tokens_read: the step's requests, and its
            attention's query-key pairs and KV tokens read (``StepStats``).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_batched_tokens: int = 0
    num_preemptions: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    step_s: float = 0.0
    forward_s: float = 0.0
    start_time: float = 0.0
    spec_decoding: "SpecDecodingStats | None" = None
    kv_transfer_s: list[float] = field(default_factory=list)
    num_sequences: int = 0
    num_attention_pairs: int = 0
    num_kv_tokens_read: int = 0


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counts (vLLM's ``SpecDecodingStats``): drafts verified (one per
    request and step that had draft tokens), their tokens, the tokens accepted, and per draft
    position the drafts accepted up to it (so never rising with the position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        grow = num_accepted_tokens - len(self.num_accepted_tokens_per_pos)
        if grow > 0:
            self.num_accepted_tokens_per_pos += [0] * grow
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per = self.num_accepted_tokens_per_pos
        per += [0] * (len(other.num_accepted_tokens_per_pos) - len(per))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per[i] += n

    def summary(self, num_speculative_tokens: int | None = None) -> str:
        """vLLM's log line: mean acceptance length (1 + accepted per draft), counts, the
        acceptance rate per position and overall."""
        k = num_speculative_tokens or len(self.num_accepted_tokens_per_pos)
        per = (self.num_accepted_tokens_per_pos + [0] * k)[:k]
        d = max(1, self.num_drafts)
        rates = ", ".join(f"{n / d:.3f}" for n in per)
        rate = self.num_accepted_tokens / max(1, self.num_draft_tokens)
        return (f"SpecDecoding metrics: Mean acceptance length: "
                f"{1 + self.num_accepted_tokens / d:.2f}, Accepted: {self.num_accepted_tokens} "
                f"tokens, Drafted: {self.num_draft_tokens} tokens, Per-position acceptance "
                f"rate: {rates}, Avg Draft acceptance rate: {100 * rate:.1f}%")


@dataclass
class FinishedRequestStats:
    """A finished request. Times in seconds.

    TPOT = (E2E - TTFT) / (output tokens - 1), undefined (None) for <= 1 output token
    (vLLM's definition). Queue time = first scheduled - arrival, prefill time = first token -
    first scheduled: both None for a request the front end finished (a client gone), whose
    first scheduling it did not hear of.
    """

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    ttft: float | None
    tpot: float | None
    prefill_time: float | None
    decode_time: float | None


class StatLogger(Protocol):
    """Receives every step's stats and the requests that finished in it; ``it`` is None for
    requests that finished outside a step (the front end aborted them: client gone)."""

    def record(self, it: IterationStats | None, finished: list[FinishedRequestStats]) -> None: ...


def log_stats(loggers: list[StatLogger], it, finished, log) -> None:
    """Give every stat logger a step's records (``it`` None: only requests the front end
    finished); a logger that raises (disk full, ...) is logged and dropped, so it cannot cost
    the outputs."""
    for lg in list(loggers):
        try:
            lg.record(it, finished)
        except Exception:
            log.exception("stat logger %s failed; it is dropped", type(lg).__name__)
            loggers.remove(lg)


@dataclass
class EngineSummary:
    """Totals since start: what the demo prints as the scheduler summary."""

    num_steps: int = 0
    num_batched_tokens: int = 0
    max_batched_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    peak_kv_cache_usage: float = 0.0
    step_s: float = 0.0
    forward_s: float = 0.0
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    def record(self, it: IterationStats | None, finished: list[FinishedRequestStats]) -> None:
        if it is None:
            return
        if it.spec_decoding is not None:
            self.spec_decoding.add(it.spec_decoding)
        self.num_steps += 1
        self.num_batched_tokens += it.num_batched_tokens
        self.max_batched_tokens = max(self.max_batched_tokens, it.num_batched_tokens)
        self.num_prompt_tokens += it.num_prompt_tokens
        self.num_generation_tokens += it.num_generation_tokens
        self.num_preemptions += it.num_preemptions
        self.peak_kv_cache_usage = max(self.peak_kv_cache_usage, it.kv_cache_usage)
        self.step_s += it.step_s
        self.forward_s += it.forward_s

    @property
    def mean_tokens_per_step(self) -> float:
        return self.num_batched_tokens / self.num_steps if self.num_steps else 0.0


class SpecDecodingLogger:
    """Logs vLLM's "SpecDecoding metrics" line (:meth:`SpecDecodingStats.summary`) every
    ``interval_s`` seconds in which drafts were verified, for the drafts of that interval: at
    a step's stats, or at :meth:`tick` (the server's receive loop calls it while idle, so the
    last drafts of a busy stretch are logged on time)."""

    def __init__(self, log, num_speculative_tokens: int, interval_s: float = 10.0,
                 clock=None):
        import time
        self.log, self.k, self.interval_s = log, num_speculative_tokens, interval_s
        self.clock = clock or time.monotonic
        self.stats, self.since = SpecDecodingStats(), self.clock()

    def record(self, it: IterationStats | None, finished: list[FinishedRequestStats]) -> None:
        if it is None or it.spec_decoding is None:
            return
        self.stats.add(it.spec_decoding)
        self.tick()

    def tick(self) -> None:
        """Log the interval's line if it is over and drafts were verified in it."""
        now = self.clock()
        if now - self.since >= self.interval_s:
            if self.stats.num_drafts:
                self.log.info("%s", self.stats.summary(self.k))
            self.stats, self.since = SpecDecodingStats(), now


class StepTraceLogger:
    """Writes one JSON line per engine step (``sloserve serve --step-trace FILE``): start time
    (s, monotonic), step seconds, queue sizes after it, its composition (decode contexts,
    prefill chunks as [tokens, start], and in a verify step ``decode_drafts``: the draft tokens
    of each decode, with the step's ``num_draft_tokens`` and ``num_accepted_draft_tokens``) and the requests it admitted ([arrival time, prompt tokens]), with the
    request ids of the prefill chunks and of the admitted requests in the same order
    (``prefill_ids``, ``admitted_ids``: which request a chunk belongs to, for tests and
    debugging). The simulator's profiler fits its cost model to the time from one step's start to
    the next one's while the engine stays busy (``sloserve profile --from-trace``): what a step
    really costs in a serving process. Written by the engine core (it has the composition).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str):
        self._f = open(path, "w", encoding="utf-8", buffering=1)

    def record(self, out, step, stats, admitted: list[tuple[float, int]]) -> None:
        """One line for a step.

        Args:
            out: the step's SchedulerOutput; step: its StepStats; stats: the SchedulerStats after it.
            admitted: (arrival time, prompt tokens, request id) of the requests first scheduled
                in it.
        """
        import json
        dec, pre = out.composition()
        row = {
            "t": round(step.start_time, 6), "step_s": round(step.step_s, 6),
            "running": stats.num_running, "waiting": stats.num_waiting,
            "decode_contexts": list(dec), "prefill_chunks": [list(c) for c in pre],
            "admitted": [[round(a, 6), n] for a, n, _ in admitted],
            "prefill_ids": [s.request_id for s in out.scheduled if not s.is_decode],
            "admitted_ids": [rid for _, _, rid in admitted]}
        drafts = [s.num_new_tokens - 1 for s in out.scheduled if s.is_decode]
        if any(drafts):  # a verify step: the draft tokens of each decode, in decode_contexts order
            row["decode_drafts"] = drafts
            row["num_draft_tokens"] = step.num_draft_tokens
            row["num_accepted_draft_tokens"] = step.num_accepted_draft_tokens
        self._f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._f.close()
