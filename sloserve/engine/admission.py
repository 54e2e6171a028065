"""Overload control: the queue limit and SLO-aware admission, decided at arrival.

Plain Python (no torch, no clock of its own). :func:`check_arrival` is the one entry: the API
process calls it on the core's published :class:`~sloserve.engine.messages.SchedulerStats`
(plus the requests still on their way to the core), the simulator on its engine core's
``stats()``, so both reject the same requests for the same reasons.

* Queue limit (``--max-waiting-requests N``): a request is rejected (HTTP 429) when admitting
  it would make more than N requests wait: those the core reports waiting plus every request
  admitted that the core has not queued yet (the core queues each arrival before it schedules
  it, so each of them is a waiting request once it lands, free running seats or not). A request
  of ``n`` choices needs ``n`` places, all or none. With the API process reserving its places
  before it forwards (``AsyncLLM.reserve``), no burst can overfill the queue; only a preemption
  (a running request sent back to the queue when the KV cache runs out) can.
* SLO-aware admission (``--ttft-slo-ms T``, in the spirit of DistServe's goodput, Zhong et al.
  OSDI'24): the request's TTFT is estimated in whole engine steps, because a prompt's first
  token comes at the end of the step that computes its last chunk, and that step lasts as long
  as everything it carries: the rest of the step now running, then
  ``ceil((Q + P) / (budget - D))`` steps of the measured prefill-step time, where Q is the
  prompt tokens ahead (every waiting request's and the running prefills' remaining tokens,
  plus those on their way), P its own, budget ``--max-num-batched-tokens`` and D the running
  decodes, which take their tokens of every step first. Over T it is rejected at arrival
  (``--slo-admission reject``, 429), or queued and moved behind the requests that can still
  meet T (``--slo-admission defer``, done by the scheduler). Whole steps, not tokens per
  second: a prompt arriving at an idle queue still waits for the step in flight and then for a
  whole mixed step, which a rate-only estimate leaves out.

* Compiles per client (``--max-pending-compiles-per-client N``, :class:`CompileSlots`): a
  request with a structured-output spec new to the server makes the engine core compile a
  grammar, which can take tens of seconds of its compile workers' time; a client (the API
  process's name for it: its peer address) may have N such grammars compiling at once, and a
  request that would add one more is rejected (429). The engine core knows no clients, so the
  API process counts: a grammar is pending for a client from the arrival of its first request
  until one of its requests gets its first output (the core runs no request of a spec before
  the spec compiled) or the last of them ends; a spec that got an output is then known
  compiled (the last :data:`KNOWN_SPECS` such specs) and no longer counts.

A rejected request costs the server one estimate (no queueing, no KV blocks), so what was
admitted before is neither lost nor slowed.
"""
from __future__ import annotations

import collections
import hashlib
import math
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StepRates:
    """The engine's measured speeds over its recent steps.

    Attributes:
        prefill_tokens_per_s: the token-weighted median, over the last ``window`` steps that had
            prefill tokens, of each step's prefill tokens per second of wall time (the decodes
            sharing the step included): a tiny tail chunk weighs little, and a rare slow step
            (a first GEMM shape, a page fault) does not move it. 0 until measured.
        prefill_step_s: the time of a step with prefill tokens the estimate plans for, s: the
            larger of the 90th percentile over the last ``window`` such steps and the latest
            one (steps grow as admitted requests turn into decodes, and a first token is late
            when its step is one of the slow ones, which a median would miss). 0 until
            measured.
        decode_step_s: median time of the last ``window`` decode-only steps, s; 0 until measured.
        prefill_token_s: what one more prompt token adds to a step, s: the median, over the last
            ``window`` steps with prefill tokens, of (step time - decode_step_s) / prefill
            tokens (a step's weight reads are priced in decode_step_s, so a small chunk is
            not charged them). 0 until both kinds of step were measured.
        paced_prefill_tokens: prompt tokens that add about one decode step's time to a step
            (decode_step_s / prefill_token_s, rounded down to a multiple of
            ``PACED_MIN_TOKENS``, at least that): the chunk of a paced long prefill (see
            ``Scheduler``, prefill pacing). 0 until measured.
    """

    #: the smallest paced chunk: under it a long prompt re-reads every weight for a few tokens
    #: per step, and its prefill's total time grows (16 rows are one tile of the int8 product)
    PACED_MIN_TOKENS = 16

    def __init__(self, window: int = 32):
        self._prefill: collections.deque = collections.deque(maxlen=window)  # (tok/s, tokens)
        self._decode: collections.deque = collections.deque(maxlen=window)
        self._prefill_steps: collections.deque = collections.deque(maxlen=window)
        self._prefill_cost: collections.deque = collections.deque(maxlen=window)  # (s, tokens)

    def update(self, prefill_tokens: int, decode_tokens: int, step_s: float) -> None:
        if step_s <= 0:
            return
        if prefill_tokens:
            self._prefill.append((prefill_tokens / step_s, prefill_tokens))
            self._prefill_steps.append(step_s)
            self._prefill_cost.append((step_s, prefill_tokens))
        elif decode_tokens:
            self._decode.append(step_s)

    @property
    def prefill_tokens_per_s(self) -> float:
        if not self._prefill:
            return 0.0
        pts = sorted(self._prefill)
        half, acc = sum(w for _, w in pts) / 2, 0
        for rate, w in pts:
            acc += w
            if acc >= half:
                return rate
        return pts[-1][0]

    @property
    def prefill_step_s(self) -> float:
        if not self._prefill_steps:
            return 0.0
        ts = sorted(self._prefill_steps)
        return max(ts[min(len(ts) - 1, int(0.9 * len(ts)))], self._prefill_steps[-1])

    @property
    def decode_step_s(self) -> float:
        return statistics.median(self._decode) if self._decode else 0.0

    def _token_price(self, d: float) -> float:
        """prefill_token_s against a decode step of ``d`` s (> 0, with prefill steps seen)."""
        return statistics.median(max(0.0, s - d) / n for s, n in self._prefill_cost)

    @property
    def prefill_token_s(self) -> float:
        d = self.decode_step_s
        return self._token_price(d) if d > 0 and self._prefill_cost else 0.0

    @property
    def paced_prefill_tokens(self) -> int:
        d = self.decode_step_s
        if d <= 0 or not self._prefill_cost:
            return 0
        per_token = self._token_price(d)
        if per_token <= 0:  # prompt tokens measured free: no reason to hold them back
            return 1 << 30
        n = int(d / per_token * (1 + 1e-9))  # (20.0 is 20, not 19)
        # whole multiples of 16: a chunk is tiles of 16 rows, and the chunking (and with it a
        # bf16 run's rounding) moves only when the measured prices move by a tile's worth
        return max(self.PACED_MIN_TOKENS, n - n % self.PACED_MIN_TOKENS)


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused (an HTTP 429): ``message`` names the limit and the value;
    ``retry_after_s`` is when the queue ahead should have drained (whole seconds, >= 1)."""

    message: str
    retry_after_s: int


def estimate_ttft_s(queue_tokens: int, prompt_tokens: int, prefill_budget: int,
                    prefill_step_s: float, wait_s: float = 0.0) -> float | None:
    """The TTFT estimate of a new request, s (see the module docstring).

    Args:
        queue_tokens: prompt tokens ahead of it; prompt_tokens: its own (uncached) tokens.
        prefill_budget: prompt tokens a step can take: the token budget less the running
            decodes (at least 1).
        prefill_step_s: measured time of a step that carries prefill tokens.
        wait_s: time until the next step can start (the rest of the step in flight), or, in
            the simulator, the time the request has already waited.

    Returns None while the step time is unknown (the first requests after start are admitted).
    """
    if prefill_step_s <= 0:
        return None
    return wait_s + prefill_steps(queue_tokens + prompt_tokens, prefill_budget) * prefill_step_s


def prefill_steps(tokens: int, prefill_budget: int) -> int:
    """Steps ``tokens`` prompt tokens take at ``prefill_budget`` (at least 1) a step."""
    return math.ceil(tokens / max(1, prefill_budget))


def check_admission(*, num_waiting: int, queue_tokens: int, prompt_tokens: int,
                    prefill_budget: int, prefill_step_s: float, prefill_tokens_per_s: float,
                    wait_s: float = 0.0, max_waiting_requests: int | None,
                    ttft_slo_s: float | None, reject_over_slo: bool,
                    num_requests: int = 1) -> Rejection | None:
    """None to admit, else the Rejection. ``num_waiting`` / ``queue_tokens``: requests waiting
    and prompt tokens ahead, both counting what is on its way to the core; ``num_requests``:
    the places the arrival needs in the queue (its ``n`` choices); the prefill rate only sets
    ``Retry-After``; the rest as for :func:`estimate_ttft_s`."""
    drain = queue_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 1.0
    retry = max(1, math.ceil(drain))
    if max_waiting_requests is not None and num_waiting + num_requests > max_waiting_requests:
        need = "" if num_requests == 1 else f" and this one needs {num_requests} places"
        return Rejection(f"the server is overloaded: {num_waiting} requests are waiting{need}, "
                         f"the limit is {max_waiting_requests} (--max-waiting-requests); retry "
                         f"in {retry} s", retry)
    if ttft_slo_s is not None and reject_over_slo:
        est = estimate_ttft_s(queue_tokens, prompt_tokens, prefill_budget, prefill_step_s, wait_s)
        if est is not None and est > ttft_slo_s:
            steps = prefill_steps(queue_tokens + prompt_tokens, prefill_budget)
            return Rejection(f"the server cannot meet its TTFT SLO for this request: estimated "
                             f"TTFT {est * 1e3:.0f} ms ({queue_tokens} prompt tokens queued "
                             f"ahead + {prompt_tokens}, {max(1, prefill_budget)} per step: "
                             f"{steps} steps of {prefill_step_s * 1e3:.0f} ms after "
                             f"{wait_s * 1e3:.0f} ms), limit {ttft_slo_s * 1e3:.0f} ms "
                             f"(--ttft-slo-ms); retry in {retry} s", retry)
    return None


@dataclass(frozen=True)
class AdmissionLimits:
    """The overload-control settings (see the module docstring).

    Attributes:
        max_waiting_requests: ``--max-waiting-requests`` (None: no queue limit).
        ttft_slo_s: ``--ttft-slo-ms`` in s (None: no TTFT limit).
        reject_over_slo: ``--slo-admission reject``: a request over ttft_slo_s is refused at
            arrival (with ``defer`` the scheduler defers it instead).
    """

    max_waiting_requests: int | None = None
    ttft_slo_s: float | None = None
    reject_over_slo: bool = False

    @classmethod
    def of(cls, config) -> "AdmissionLimits":
        """The limits of an :class:`~sloserve.config.EngineConfig`."""
        return cls(config.max_waiting_requests,
                   config.ttft_slo_ms / 1e3 if config.ttft_slo_ms else None,
                   config.slo_admission == "reject")

    @property
    def active(self) -> bool:
        """Some request may be refused at arrival."""
        return self.max_waiting_requests is not None or (self.ttft_slo_s is not None
                                                         and self.reject_over_slo)


class LoadView(Protocol):
    """What admission reads of an engine (a :class:`~sloserve.engine.messages.SchedulerStats`):
    the waiting requests and the prompt tokens still to compute
    (the waiting ones' and the running prefills'), the prompt tokens the next step can take,
    and the measured step time and prefill rate (0 until measured)."""

    num_waiting: int
    num_waiting_tokens: int
    prefill_budget: int
    prefill_step_s: float
    prefill_tokens_per_s: float


def check_arrival(limits: AdmissionLimits, load: LoadView, prompt_tokens: int | Sequence[int],
                  wait_s: float, in_transit_tokens: Sequence[int] = ()) -> Rejection | None:
    """Overload control for a request arriving at an engine in state ``load``: None to
    admit, else the Rejection.

    Args:
        prompt_tokens: its prompt tokens, or those of each of its choices (a request of ``n``
            choices is admitted whole or not at all: it needs ``n`` places in the queue; its
            TTFT estimate is its longest choice's, which share a prompt and its cached blocks).
        wait_s: time until the engine's next step can start, s: the rest of the step in
            flight (the API process estimates it), or the time the request already waited
            (the simulator admits between steps).
        in_transit_tokens: the prompt tokens of each request admitted to the engine that it
            has not queued yet: each waits ahead of this one (the core queues every arrival
            before it schedules it).
    """
    if not limits.active:
        return None
    choices = [prompt_tokens] if isinstance(prompt_tokens, int) else list(prompt_tokens)
    return check_admission(
        num_waiting=load.num_waiting + len(in_transit_tokens),
        queue_tokens=load.num_waiting_tokens + sum(in_transit_tokens),
        prompt_tokens=max(choices), prefill_budget=load.prefill_budget,
        prefill_step_s=load.prefill_step_s, prefill_tokens_per_s=load.prefill_tokens_per_s,
        wait_s=wait_s, max_waiting_requests=limits.max_waiting_requests,
        ttft_slo_s=limits.ttft_slo_s, reject_over_slo=limits.reject_over_slo,
        num_requests=len(choices))


#: specs :class:`CompileSlots` remembers as compiled (the engine core caches as many grammars)
KNOWN_SPECS = 256


class CompileSlots:
    """The per-client cap on structured-output grammars compiling (see the module docstring).

    Args:
        limit: ``--max-pending-compiles-per-client``: grammars new to the server one client may
            have compiling at once; 0: no cap.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        #: client -> spec digest -> requests of that client waiting for that grammar
        self._pending: dict[str, dict[bytes, int]] = {}
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def acquire(self, client: str, spec_key: str) -> "CompileSlot | Rejection | None":
        """A slot for a request of ``client`` with the spec ``spec_key`` (``spec.key``): None
        when nothing needs holding (no cap, or a spec known compiled), a Rejection when the
        client has ``limit`` other grammars pending."""
        if not self.limit:
            return None
        digest = hashlib.sha256(spec_key.encode("utf-8", "surrogatepass")).digest()
        with self._lock:
            if digest in self._known:
                self._known.move_to_end(digest)
                return None
            mine = self._pending.setdefault(client, {})
            if digest not in mine and len(mine) >= self.limit:
                return Rejection(
                    f"client {client} has {len(mine)} structured-output grammars compiling, "
                    f"the limit is {self.limit} per client (--max-pending-compiles-per-client); "
                    f"retry when one finished, in 1 s", 1)
            mine[digest] = mine.get(digest, 0) + 1
        return CompileSlot(self, client, digest)

    def pending(self, client: str) -> int:
        """Grammars pending for ``client``."""
        with self._lock:
            return len(self._pending.get(client, ()))

    def _done(self, client: str, digest: bytes, compiled: bool) -> None:
        with self._lock:
            if compiled:
                self._known[digest] = None
                self._known.move_to_end(digest)
                while len(self._known) > KNOWN_SPECS:
                    self._known.popitem(last=False)
            mine = self._pending.get(client)
            if mine is None or digest not in mine:
                return
            mine[digest] -= 1
            if mine[digest] <= 0 or compiled:
                del mine[digest]
            if not mine:
                del self._pending[client]


class CompileSlot:
    """One request's hold on its client's count: given back once, when it got its first
    output (``compiled``) or ended (``release``)."""

    def __init__(self, slots: CompileSlots, client: str, digest: bytes):
        self._slots, self._client, self._digest = slots, client, digest
        self._held = True

    def compiled(self) -> None:
        """Its grammar compiled: the spec no longer counts for anyone (idempotent)."""
        if self._held:
            self._held = False
            self._slots._done(self._client, self._digest, True)

    def release(self) -> None:
        """The request ended (idempotent)."""
        if self._held:
            self._held = False
            self._slots._done(self._client, self._digest, False)
