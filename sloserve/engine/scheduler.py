"""Unified token-budget scheduler (iteration-level batching).

Each engine step the scheduler decides which requests run and how many of their tokens go
through the model, under a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Policies:

* ``chunked`` (default, Sarathi-Serve, Agrawal et al. OSDI'24, section 4): running decodes first,
  one token each; the rest of the budget to prefill in FCFS order, splitting a prompt that does not
  fit into chunks over several steps. Prefill chunks and decodes share one forward pass.
* ``naive`` (Orca-style continuous batching without chunking, Yu et al. OSDI'22): a waiting prompt
  is prefilled whole in one step together with the running decodes. The token budget is
  max(max_num_batched_tokens, max_model_len) so any admissible prompt fits.
* ``static``: a batch is admitted only when nothing runs; it runs until all of it finishes.

When a running request cannot get a KV block the most recently admitted running request is
preempted: its blocks are freed, it goes back to the front of the waiting queue, and later its
prompt plus the tokens it already generated are recomputed (vLLM's recompute preemption).

Plain Python: no torch and no clock (the caller passes `now`), so a simulator can drive it with
a cost model instead of a model runner.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.request import Request, RequestStatus


class SchedulingPolicy(str, enum.Enum):
    """`--scheduling-policy`: chunked (default), naive (no chunking) or static batching."""

    CHUNKED = "chunked"
    NAIVE = "naive"
    STATIC = "static"


@dataclass
class SchedulerConfig:
    """Scheduler limits.

    Attributes:
        max_num_batched_tokens: token budget per step (tokens).
        max_num_seqs: most requests running at once.
        max_model_len: longest prompt + output (tokens).
        policy: chunked, naive or static.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    policy: SchedulingPolicy = SchedulingPolicy.CHUNKED

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def token_budget(self) -> int:
        """Tokens per step: the configured budget, or enough for any whole prompt without chunking."""
        if self.policy is SchedulingPolicy.CHUNKED:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


@dataclass
class ScheduledRequest:
    """One request's share of a step: positions [start_pos, start_pos + num_tokens)."""

    request: Request
    num_tokens: int
    start_pos: int
    #: this chunk reaches the request's newest token, so a next token is sampled after it
    samples: bool = field(init=False)
    #: a decode: one new token of a request that already has output and a full KV cache
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end_pos == self.request.num_tokens
        self.is_decode = (self.num_tokens == 1 and self.samples
                          and self.request.num_output_tokens > 0)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass
class SchedulerOutput:
    """What one engine step runs. `scheduled` lists decodes first, then prefill chunks."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue, the running list (in admission order) and the KV cache manager."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue management
    def add_request(self, request: Request) -> None:
        """Queue a request (FCFS).

        Raises:
            ValueError: empty prompt, prompt longer than max_model_len, prompt + max_tokens over
                the KV cache capacity, or a duplicate id.
        """
        n = request.num_prompt_tokens
        if n < 1:
            raise ValueError("prompt must contain at least 1 token, got 0")
        if n > self.config.max_model_len:
            raise ValueError(f"prompt has {n} tokens, over max_model_len={self.config.max_model_len}")
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        mt = request.sampling_params.max_tokens
        need = min(n + mt, self.config.max_model_len) if mt is not None else self.config.max_model_len
        if need > capacity:  # it would end up preempting itself for ever
            raise ValueError(f"request needs up to {need} tokens of KV cache (prompt {n} + "
                             f"max_tokens {mt}), over the cache capacity of {capacity} tokens")
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (stop string, abort, ...) a queued or running request and free its blocks.

        Unknown or already finished ids are ignored (returns None).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ----------------------------------------------------------------- scheduling
    def _preempt(self, req: Request, out: SchedulerOutput, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free `req` and queue it at the front for recompute. Returns budget refunded."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_request_ids.append(req.request_id)
        sr = scheduled.pop(req.request_id, None)
        return sr.num_tokens if sr else 0

    def _allocate_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput,
                             scheduled: dict[str, ScheduledRequest]) -> tuple[bool, int]:
        """Make room for `num_tokens` more of running `req`, preempting the newest requests.

        Returns (allocated, budget refunded by preempting already scheduled requests).
        """
        refund = 0
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_tokens):
            victim = self.running[-1]
            refund += self._preempt(victim, out, scheduled)
            if victim is req:
                return False, refund
        return True, refund

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Pick this step's work. `now` (seconds) stamps first_scheduled_time for queue time."""
        cfg = self.config
        chunked = cfg.policy is SchedulingPolicy.CHUNKED
        budget = cfg.token_budget
        out = SchedulerOutput()
        scheduled: dict[str, ScheduledRequest] = {}

        # 1. running decodes, one token each, in admission order
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.num_tokens_to_compute != 1:
                continue
            ok, refund = self._allocate_or_preempt(req, 1, out, scheduled)
            budget += refund
            if ok:
                scheduled[req.request_id] = ScheduledRequest(req, 1, req.num_computed_tokens)
                budget -= 1

        # 2. running requests part-way through their prefill (chunked, or a static batch)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in scheduled:
                continue
            n = req.num_tokens_to_compute
            if n > budget:
                if not chunked:
                    continue
                n = budget
            ok, refund = self._allocate_or_preempt(req, n, out, scheduled)
            budget += refund
            if ok:
                scheduled[req.request_id] = ScheduledRequest(req, n, req.num_computed_tokens)
                budget -= n

        # 3. admit waiting requests FCFS (not in a step that preempted: it would thrash)
        may_admit = not out.preempted_request_ids
        if cfg.policy is SchedulingPolicy.STATIC and self.running:
            may_admit = False
        while may_admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens_to_compute
            if n > budget:
                if not chunked:
                    break  # head-of-line: the whole prompt must fit
                n = budget
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n, req.num_computed_tokens)
            budget -= n

        # decodes first, then prefill chunks in admission order
        order = {r.request_id: i for i, r in enumerate(self.running)}
        items = list(scheduled.values())
        items.sort(key=lambda s: (not s.is_decode, order[s.request_id]))
        out.scheduled = items
        return out

    # ----------------------------------------------------------------- results
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           now: float = 0.0) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that hit a stop condition.

        Args:
            out: the SchedulerOutput this step ran.
            sampled: request id -> new token id, for every scheduled request whose chunk `samples`.
            now: time of the step's end (seconds), stamped on token and finish times.

        Returns:
            Requests finished by EOS / stop token ids (FINISHED_STOPPED) or by max_tokens /
            max_model_len (FINISHED_LENGTH); their blocks are already freed.
        """
        finished: list[Request] = []
        for sr in out.scheduled:
            req = sr.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += sr.num_tokens
            if req.num_computed_tokens != req.num_tokens:
                continue
            tok = sampled[req.request_id]
            req.output_token_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            status = self._check_stop(req, tok)
            if status is not None:
                self.finish_request(req.request_id, status)
                req.finished_time = now
                finished.append(req)
        return finished

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        if (not sp.ignore_eos and tok in req.eos_token_ids) or tok in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
