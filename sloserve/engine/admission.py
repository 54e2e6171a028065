"""Overload control: the queue limit and SLO-aware admission, decided at arrival.

Plain Python (no torch, no clock of its own), used by the API process on the core's published
:class:`~sloserve.engine.messages.SchedulerStats` and by the simulator on its own scheduler, so
both reject the same requests for the same reasons.

* Queue limit (``--max-waiting-requests N``): a request is rejected (HTTP 429) when N requests
  already wait: those the core reports waiting plus those sent to it that it has not queued yet.
* SLO-aware admission (``--ttft-slo-ms T``, in the spirit of DistServe's goodput, Zhong et al.
  OSDI'24): the request's TTFT is estimated as the prompt tokens ahead of it (every waiting
  request's and the running prefills' remaining tokens, plus those on their way) and its own,
  at the engine's measured prefill rate, which already includes the decodes that share its
  steps, plus one decode step; over T it is rejected at arrival (``--slo-admission reject``,
  429), or queued and moved behind the requests that can still meet T
  (``--slo-admission defer``, done by the scheduler).

A rejected request costs the server one estimate (no queueing, no KV blocks), so what was
admitted before is neither lost nor slowed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class StepRates:
    """The engine's measured speeds, as exponentially decayed sums over its steps (weight
    ``decay`` per step), so a burst of tiny chunks does not swing them.

    Attributes:
        prefill_tokens_per_s: prefill tokens per second of wall time of the steps that had any
            (the decodes sharing those steps included); 0 until measured.
        decode_step_s: mean time of steps with decodes, s; 0 until measured.
    """

    decay: float = 0.9
    _pt: float = 0.0
    _ps: float = 0.0
    _ds: float = 0.0
    _dn: float = 0.0

    def update(self, prefill_tokens: int, decode_tokens: int, step_s: float) -> None:
        if prefill_tokens:
            self._pt = self.decay * self._pt + prefill_tokens
            self._ps = self.decay * self._ps + step_s
        elif decode_tokens:
            self._ds = self.decay * self._ds + step_s
            self._dn = self.decay * self._dn + 1

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._pt / self._ps if self._ps > 0 else 0.0

    @property
    def decode_step_s(self) -> float:
        return self._ds / self._dn if self._dn > 0 else 0.0


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused (an HTTP 429): ``message`` names the limit and the value;
    ``retry_after_s`` is when the queue ahead should have drained (whole seconds, >= 1)."""

    message: str
    retry_after_s: int


def estimate_ttft_s(queue_tokens: int, prompt_tokens: int, prefill_tokens_per_s: float,
                    decode_step_s: float) -> float | None:
    """The TTFT estimate of a new request (see the module docstring); None while the prefill
    rate is unknown (the first requests after start are always admitted)."""
    if prefill_tokens_per_s <= 0:
        return None
    return (queue_tokens + prompt_tokens) / prefill_tokens_per_s + decode_step_s


def check_admission(*, num_waiting: int, queue_tokens: int, prompt_tokens: int,
                    prefill_tokens_per_s: float, decode_step_s: float,
                    max_waiting_requests: int | None, ttft_slo_s: float | None,
                    reject_over_slo: bool) -> Rejection | None:
    """None to admit, else the Rejection. ``num_waiting`` / ``queue_tokens``: requests waiting
    and prompt tokens ahead, both counting what is on its way to the core."""
    drain = queue_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else 1.0
    retry = max(1, math.ceil(drain))
    if max_waiting_requests is not None and num_waiting >= max_waiting_requests:
        return Rejection(f"the server is overloaded: {num_waiting} requests are waiting, the "
                         f"limit is {max_waiting_requests} (--max-waiting-requests); retry "
                         f"in {retry} s", retry)
    if ttft_slo_s is not None and reject_over_slo:
        est = estimate_ttft_s(queue_tokens, prompt_tokens, prefill_tokens_per_s, decode_step_s)
        if est is not None and est > ttft_slo_s:
            return Rejection(f"the server cannot meet its TTFT SLO for this request: estimated "
                             f"TTFT {est * 1e3:.0f} ms ({queue_tokens} prompt tokens queued "
                             f"ahead), limit {ttft_slo_s * 1e3:.0f} ms (--ttft-slo-ms); retry "
                             f"in {retry} s", retry)
    return None
