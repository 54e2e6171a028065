"""The workload records the bench and the simulator share: what a request sends
(:class:`SampleRequest`) and what it measured (:class:`RequestRecord`).

Plain data: the bench (:mod:`sloserve.bench`) fills them over HTTP, the simulator
(:mod:`sloserve.sim`) from its virtual clock, and the metrics read them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sloserve.latency import tpot

#: tag prefix of the requests of one ``shared-prefix`` group (``group0``, ``group1``...), which
#: the simulator's prefix-affinity router keeps on one replica
PREFIX_GROUP_TAG = "group"


@dataclass
class SampleRequest:
    """One request of a workload.

    Attributes:
        prompt: the prompt text (the user message for chat endpoints).
        prompt_len: its length in tokens, counted without special tokens (as vLLM's bench does).
        expected_output_len: ``max_tokens`` to send (tokens).
        arrival_time: send time in s after the start, for replayed traces; None = use the
            benchmark's arrival process.
        tag: workload label of the request (``short`` / ``long`` in ``mixed``, the group in
            ``shared-prefix``); plots mark the arrivals of ``long`` requests.
        priority: the request's ``priority`` (vLLM's: lower runs first under
            ``--scheduling-policy priority``; a trace's ``priority`` field), 0 by default.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    arrival_time: float | None = None
    tag: str | None = None
    priority: int = 0


@dataclass
class RequestRecord:
    """What one request measured (times in s, from ``time.perf_counter`` for the bench, the
    virtual clock for the simulator).

    Attributes:
        success: HTTP 200, no error event, and at least one content chunk.
        error: the error message when not successful ("" otherwise).
        prompt_len: prompt tokens: ``usage.prompt_tokens`` when the server reports it (for chat
            that includes the template's tokens, as in vLLM's bench), else the workload's count.
        output_tokens: output tokens: the final ``usage`` event's, else counted with the
            tokenizer, else the number of content chunks.
        send_time: perf_counter at send.
        ttft: first content chunk - send (s); 0.0 when there was none.
        itl: gaps between consecutive content chunks (s); len = content chunks - 1.
        latency: E2E, last content chunk - send (s).
        chunk_times: perf_counter of every content chunk.
        generated_text: the concatenated text.
        server_prompt_tokens: ``usage.prompt_tokens`` (None without usage).
        queue_time: time spent waiting client-side for a ``max_concurrency`` slot before the
            send (s); not part of TTFT or E2E.
        tag: workload label.
    """

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    send_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    server_prompt_tokens: int | None = None
    queue_time: float = 0.0
    tag: str | None = None

    def set_times_from_chunks(self) -> None:
        """TTFT, E2E latency and ITL from ``send_time`` and ``chunk_times`` (no chunks: left 0)."""
        ct = self.chunk_times
        if ct:
            self.ttft = ct[0] - self.send_time
            self.latency = ct[-1] - self.send_time
            self.itl = [b - a for a, b in zip(ct, ct[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1) in s; None when output <= 1 or not successful."""
        return tpot(self.latency, self.ttft, self.output_tokens) if self.success else None
