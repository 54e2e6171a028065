"""Unified token-budget scheduler (iteration-level batching).

Each step it picks which requests run and how many of their tokens go through the model, under
a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

* ``chunked`` (default; Sarathi-Serve): running decodes first, one token each, then prefill in
  queue order, a prompt that does not fit split into chunks; chunks and decodes share a step.
* ``naive`` (Orca): a prompt is prefilled whole beside the running decodes (budget
  max(max_num_batched_tokens, max_model_len)). ``static``: admit only when nothing runs.

A request may put any number of query tokens in a step (a prefill chunk at any offset, a decode
token, draft tokens to verify; rejected drafts roll back in `update_from_output`). With prefix
caching a request starts after its longest run of cached full blocks. When a running request
cannot get a KV block the most recently admitted one is preempted by recompute (vLLM's).

``priority`` (vLLM's queue policy): the waiting queue is ordered by (priority, arrival), lower
first; preemption takes the largest; a waiting request that cannot be admitted preempts running
ones of a strictly larger priority value. SLO-aware deferral (``ttft_slo_s``, ``slo_deferral``)
moves waiting requests whose estimated TTFT (:func:`sloserve.engine.admission.estimate_ttft_s`)
exceeds the limit behind those that can meet it; none is dropped.

Prefill pacing (chunked, on by default, off with ``ttft_slo_s``): in a step with decodes, long
prompts share ``paced_prefill_tokens``, the tokens that add about one decode step's time (set by
the engine from its measured steps, :class:`sloserve.engine.admission.StepRates`), because on a
CPU a decode step has no idle compute to hide a chunk in. A prompt is long when it has more than
``long_prompt_tokens`` (4 % of max_model_len) or more than ``LONG_PROMPT_STEPS`` (2) times the
paced tokens (its whole prefill would add more than two decode steps: a 128-token prompt at a 1B
model's speed on 2 cores). The long prompts share the pace shortest rest first, the waiting ones
that can start now included, so a short prompt does not wait out a long one's prefill. With
nothing decoding a long prompt takes the whole budget, except that short prompts pass it: while a
long prompt prefills, the prompts near the waiting queue's front that fit whole (a free seat,
free blocks, no preemption; waiting long prompts keep their places) and are short (at most ``long_prompt_tokens`` in a step nothing decodes
in, else short enough to go whole beside decodes) are admitted first and the long prompt is paced
in that step as beside a decode, so a short request waits for the step in flight, not for the
rest of the long prompt (vLLM's partial prefills let short prompts pass long ones the same way).

Structured outputs: the scheduler owns the injected structured-output manager, as vLLM's does. A
request whose grammar still compiles waits, one whose grammar failed is finished (``abort``, as
its own fault when the grammar says so: ``bad_request``, e.g. a compile over its time limit) at
the next ``schedule``; each sampling request with a grammar gets its token bitmask in the step
that schedules it, and ``update_from_output`` advances its matcher: a completed grammar finishes
the request (``stop``), a refused token or a broken matcher aborts it. A finished request
releases its grammar (``release()``, where the grammar has one), so that a compile no request
waits for any more is stopped. Requests finish here and only here (stop strings, which need
text, are checked by the front end's detokenizer, as in vLLM).

KV connector (prefill/decode disaggregation, ``sloserve.kv_transfer``): a decode instance's
``do_remote_prefill`` request takes the blocks of its whole prompt when it reaches the queue
(before the admission pass, no token budget, no seat) and waits, holding them, until its KV and
the prefill instance's first token have arrived (``update_connector_output``); then it rejoins
the queue's front and its first step is that token's decode. A prefill instance's
``do_remote_decode`` request runs to its first token; its blocks are freed once the connector
has sent them. The connector's news reaches the worker in ``SchedulerOutput``.

Every step schedules each running request past its prefill first, one token each (as long as
max_num_seqs <= max_num_batched_tokens, the default). Plain Python: no torch, no xgrammar and no
clock (the caller passes `now`), so the simulator drives it with a cost model; its output
(`sloserve.step_io.SchedulerOutput`) is plain data.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from sloserve.config import QUEUE_POLICIES, EngineConfig
from sloserve.engine.admission import StepRates, estimate_ttft_s
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.messages import EngineCoreOutput, KVTransferParams
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.request_queue import RequestQueue, create_request_queue
from sloserve.step_io import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class SchedulingPolicy(str, enum.Enum):
    """The batching mode: chunked (default), naive (``--no-enable-chunked-prefill``) or static
    (``--static-batching``)."""

    CHUNKED = "chunked"
    NAIVE = "naive"
    STATIC = "static"

    def __str__(self) -> str:
        return self.value


@dataclass
class SchedulerConfig:
    """Scheduler limits (the defaults are EngineConfig's; the engine builds this with
    ``SchedulerConfig.of``).

    Attributes:
        max_num_batched_tokens: token budget per step (tokens).
        max_num_seqs: most requests running at once.
        max_model_len: longest prompt + output (tokens; default: the embedded model's context).
        policy: the batching mode, chunked, naive or static.
        queue_policy: "fcfs" or "priority" (``--scheduling-policy``): the waiting queue's order.
        ttft_slo_s: TTFT limit (s) of SLO-aware deferral, None: off.
        slo_deferral: move waiting requests that can no longer meet ttft_slo_s behind the others.
        long_prefill_token_threshold: chunked only: at most this many query tokens of one
            request's prefill per step (0: no cap but the budget).
        enable_prefill_pacing: chunked only: pace long prompts beside decodes (module
            docstring, "Prefill pacing").
    """

    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_model_len: int = 8192
    policy: SchedulingPolicy = SchedulingPolicy(EngineConfig().batching)
    queue_policy: str = EngineConfig.scheduling_policy
    ttft_slo_s: float | None = None
    slo_deferral: bool = False
    long_prefill_token_threshold: int = 0
    enable_prefill_pacing: bool = EngineConfig.enable_prefill_pacing

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int) -> "SchedulerConfig":
        """The scheduler's view of an engine's settings (``max_model_len`` resolved)."""
        return cls(max_num_batched_tokens=config.max_num_batched_tokens,
                   max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                   policy=config.batching, queue_policy=config.scheduling_policy,
                   ttft_slo_s=config.ttft_slo_ms / 1e3 if config.ttft_slo_ms else None,
                   slo_deferral=config.slo_admission == "defer",
                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                   enable_prefill_pacing=config.enable_prefill_pacing)

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        if self.ttft_slo_s is not None:  # its TTFT estimate knows no pacing (module docstring)
            self.enable_prefill_pacing = False
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be {' or '.join(QUEUE_POLICIES)}, got "
                             f"{self.queue_policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    @property
    def long_prompt_tokens(self) -> int:
        """Prompts longer than this (tokens) are paced: 4 % of max_model_len (vLLM's default
        long-prefill threshold for partial prefills), at least one block of 16."""
        return max(16, self.max_model_len * 4 // 100)

    @property
    def token_budget(self) -> int:
        """Tokens per step: the configured budget, or enough for any whole prompt without chunking."""
        if self.policy is SchedulingPolicy.CHUNKED:
            return self.max_num_batched_tokens
        return max(self.max_num_batched_tokens, self.max_model_len)


class Scheduler:
    """Owns the waiting queue, the running list (in admission order), the KV cache manager and
    the structured-output manager.

    Args:
        config: the limits and policies.
        kv_cache_manager: the paged KV cache's blocks.
        structured_output_manager: gives each request with a structured-output spec its grammar
            (``grammar_for(spec)``, ``sloserve.engine.structured_output.StructuredOutputManager``);
            None: such requests are refused.
        kv_connector: the KV connector's scheduler half
            (``sloserve.kv_transfer.scheduler_side.SloserveConnectorScheduler``), None: no
            prefill/decode disaggregation (see "KV connector" in the module docstring).
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 structured_output_manager=None, kv_connector=None):
        self.config = config
        self.kv = kv_cache_manager
        self.structured_output_manager = structured_output_manager
        self.connector = kv_connector
        #: remote-prefill requests holding their blocks while their KV arrives
        self.waiting_for_kv: dict[str, Request] = {}
        #: the connector's (bytes sent, bytes received, failures) since start
        self.kv_transfer_totals = (0, 0, 0)
        #: waiting requests in admission order; the queue policy (fcfs or priority)
        self.waiting: RequestQueue = create_request_queue(config.queue_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_requests_received = 0
        #: the engine's measured time of a step with prefill tokens (s), for SLO-aware
        #: deferral; 0: unknown
        self.prefill_step_s = 0.0
        #: prompt tokens of a paced long prefill per step (prefill pacing), which the engine
        #: measures and sets; 0: not measured yet, no pacing
        self.paced_prefill_tokens = 0
        self.num_deferred = 0
        #: finished or aborted since the last schedule(): the runner forgets them next step
        self._finished_ids: list[str] = []
        #: requests whose grammar was still compiling when last looked at
        self._grammar_pending: set[str] = set()
        #: outputs of requests finished outside update_from_output (take_finished_outputs)
        self._finished_outputs: list[EngineCoreOutput] = []
        #: this step's requests whose grammar cannot go on: (message, the request's own fault)
        self._broken_grammars: dict[str, tuple[str, bool]] = {}

    def observe(self, rates: StepRates) -> None:
        """Take the engine's measured speeds after a step (the core's from the clock, the
        simulator's from its cost model): the prefill step time of SLO-aware deferral and the
        chunk of prefill pacing."""
        self.prefill_step_s = rates.prefill_step_s
        self.paced_prefill_tokens = rates.paced_prefill_tokens

    # ----------------------------------------------------------------- queue management
    def add_request(self, request: Request) -> None:
        """Queue a request (in the order of the queue policy).

        A request with a structured-output spec gets its grammar here (compiling off the loop).

        Raises:
            ValueError: empty prompt, prompt longer than max_model_len, prompt + max_tokens over
                the KV cache capacity, a duplicate id, or a structured-output spec without a
                structured-output manager.
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
        spec = request.sampling_params.structured_outputs
        if spec is not None and request.grammar is None:
            if self.structured_output_manager is None:
                raise ValueError("structured outputs need a structured-output manager")
            request.grammar = self.structured_output_manager.grammar_for(spec)
        if request.grammar is not None:
            self._grammar_pending.add(request.request_id)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.num_requests_received += 1
        self.waiting.add_request(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish (abort, ...) a queued or running request and free its blocks.

        Unknown or already finished ids are ignored (returns None).
        """
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_kv[request_id]
        else:
            try:
                self.waiting.remove_request(req)
            except ValueError:
                pass
        req.status = status
        free_later = False
        if self.connector is not None and (req.kv_transfer_params is not None
                                           or request_id in self.connector.loading):
            free_later, params = self.connector.request_finished(
                req, self.kv.get_block_table(request_id))
            req.kv_transfer_out = KVTransferParams(**params) if params else None
        if not free_later:  # else: freed once the connector's worker half is done with them
            self.kv.free(request_id)
        self._finished_ids.append(request_id)
        self._grammar_pending.discard(request_id)
        release = getattr(req.grammar, "release", None)
        if release is not None:  # its compile stops if no other request waits for it
            release()
        return req

    def take_finished_outputs(self) -> list[EngineCoreOutput]:
        """The outputs of requests the last ``schedule`` finished without running them (a
        grammar that failed to compile: an engine fault, the front end checked the spec; or
        the request's own when the grammar says so, ``bad_request``)."""
        outs, self._finished_outputs = self._finished_outputs, []
        return outs

    def _fail_broken_grammars(self) -> None:
        """Finish the requests whose grammar failed to compile (``abort``, with the reason)."""
        for rid in list(self._grammar_pending):
            r = self.requests.get(rid)
            if r is None or r.grammar.ready:
                self._grammar_pending.discard(rid)
            if r is not None and r.grammar.ready and r.grammar.error:
                self.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                self._finished_outputs.append(EngineCoreOutput(
                    request_id=rid, finish_reason="abort",
                    error=f"grammar compilation failed: {r.grammar.error}",
                    bad_request=bool(getattr(r.grammar, "bad_request", False))))

    def num_tokens_to_prefill(self) -> int:
        """Prompt tokens still to compute: every waiting request's and the running prefills'
        (the queue a new arrival waits behind)."""
        n = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return n + sum(r.num_tokens - r.num_computed_tokens for r in self.running
                       if r.num_tokens - r.num_computed_tokens > 1)

    def prefill_budget(self) -> int:
        """Prompt tokens the next step can take: the token budget less the running requests
        past their prefill (decodes take their token of every step first)."""
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens <= 1)
        return self.config.token_budget - decoding

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        """Requests to run or wait for, or KV transfers whose blocks are held."""
        return bool(self.requests) or (self.connector is not None
                                       and self.connector.has_pending())

    def waits_only_for_transfers(self) -> bool:
        """Nothing can run until a KV transfer finishes (or times out)."""
        return (self.connector is not None and not self.running and not len(self.waiting)
                and self.has_unfinished())

    # ----------------------------------------------------------------- scheduling
    def draft_candidates(self, with_grammar: bool = True) -> list[tuple[Request, int]]:
        """The requests that may take draft tokens in the next step (speculative decoding:
        ``sloserve.spec_decode.drafter``), each with the most drafts it can use: running,
        decoding next (past its prompt), and below ``max_tokens`` by more than one token (a
        request's last token is never a draft's). A request with a structured-output grammar
        only ``with_grammar`` (the scheduler gives each draft position its mask and cuts the
        drafts at the first one its grammar refuses, ``_fill_bitmasks``)."""
        out = []
        for req in self.running:
            if req.status is not RequestStatus.RUNNING or req.num_tokens_to_compute != 1 \
                    or (req.grammar is not None and not with_grammar):
                continue
            most = self.config.max_model_len - req.num_tokens
            mt = req.sampling_params.max_tokens
            if mt is not None:
                most = min(most, mt - req.num_output_tokens - 1)
            if most > 0:
                out.append((req, most))
        return out

    def _preempt(self, req: Request, out: SchedulerOutput, scheduled: dict[str, int]) -> int:
        """Free `req` and queue it at the front for recompute. Returns budget refunded."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.prepend_request(req)
        out.preempted_request_ids.append(req.request_id)
        return scheduled.pop(req.request_id, 0)

    def _allocate_or_preempt(self, req: Request, num_tokens: int, out: SchedulerOutput,
                             scheduled: dict[str, int]) -> tuple[bool, int]:
        """Make room for `num_tokens` more of running `req`, preempting the newest requests.

        Returns (allocated, budget refunded by preempting already scheduled requests).
        """
        refund = 0
        while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_tokens):
            victim = self._victim()
            refund += self._preempt(victim, out, scheduled)
            if victim is req:
                return False, refund
        return True, refund

    def _victim(self) -> Request:
        """The running request to preempt, by the queue policy: the newest (FCFS), or the
        largest (priority, arrival time)."""
        return self.waiting.preemption_victim(self.running)

    def _preempt_for(self, req: Request, out: SchedulerOutput, scheduled: dict[str, int]) -> int | None:
        """Preempt the running request the queue policy would take if waiting ``req`` outranks
        it (priority: a strictly larger priority value; FCFS: never); returns the budget
        refunded, None if it does not."""
        if not self.running:
            return None
        victim = self._victim()
        if not self.waiting.outranks(req, victim):
            return None
        return self._preempt(victim, out, scheduled)

    def _defer_hopeless(self, now: float) -> None:
        """SLO-aware deferral (see the module docstring): a stable partition of the waiting
        queue into requests that can still meet ttft_slo_s and those that cannot."""
        step_s, limit = self.prefill_step_s, self.config.ttft_slo_s
        if step_s <= 0 or limit is None or len(self.waiting) < 2:
            return
        budget = self.prefill_budget()
        keep, late, ahead = [], [], 0
        for r in self.waiting:
            need = r.num_tokens - r.num_computed_tokens
            est = estimate_ttft_s(ahead, need, budget, step_s, now - r.arrival_time)
            if r.first_token_time is None and est > limit:
                late.append(r)
            else:
                keep.append(r)
                ahead += need
        if late and keep:
            self.num_deferred += sum(1 for r in late if not r.deferred)
            for r in late:
                r.deferred = True
            self.waiting.move_to_back(late)

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        """Pick this step's work. `now` (seconds) stamps first_scheduled_time for queue time."""
        cfg = self.config
        if self._grammar_pending:
            self._fail_broken_grammars()
        chunked = cfg.policy is SchedulingPolicy.CHUNKED
        budget = cfg.token_budget
        # a prefill's most query tokens in this step (vLLM's long_prefill_token_threshold)
        cap = cfg.long_prefill_token_threshold if chunked and cfg.long_prefill_token_threshold > 0 \
            else budget
        out = SchedulerOutput()
        scheduled: dict[str, int] = {}  # request id -> query tokens this step
        if self.connector is not None:
            self._start_kv_loads(now)

        # 1. running decodes, one token each plus their draft tokens, in admission order
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.num_tokens_to_compute != 1:
                continue
            # drafts fit the budget and the context: positions up to num_tokens - 1 + len(spec)
            spec = req.spec_token_ids[:max(0, min(budget - 1, cfg.max_model_len - req.num_tokens))]
            req.spec_token_ids = spec
            ok, refund = self._allocate_or_preempt(req, 1 + len(spec), out, scheduled)
            budget += refund
            if ok:
                scheduled[req.request_id] = 1 + len(spec)
                budget -= 1 + len(spec)

        # prefill pacing: with decodes in this step, the long prompts share one paced chunk
        # (the shortest rest first: the others wait their turn)
        pacing = chunked and cfg.enable_prefill_pacing and self.paced_prefill_tokens > 0
        long_prompt = self._long_prompt_tokens(pacing)
        # short prompts pass a long one's prefill (module docstring, "Prefill pacing"): whole
        # up to the configured length in a step nothing decodes in, else only those short
        # enough to go whole beside decodes
        if pacing and self.waiting and not out.preempted_request_ids and any(
                r.request_id not in scheduled and r.num_prompt_tokens > long_prompt
                and r.num_tokens_to_compute > 1 for r in self.running):
            budget = self._admit_short_prompts(budget, out, scheduled, now,
                                               long_prompt if scheduled else cfg.long_prompt_tokens)
        pace = self.paced_prefill_tokens if pacing and scheduled else 0
        grants = self._pace_grants(pace, long_prompt, out, scheduled)

        # 2. running requests part-way through their prefill (chunked, or a static batch); a
        # paced one takes its grant, if any
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
            n = min(n, cap)
            if pace and req.num_prompt_tokens > long_prompt:
                n = min(n, grants.get(req.request_id, 0))
                if n <= 0:
                    continue
            ok, refund = self._allocate_or_preempt(req, n, out, scheduled)
            budget += refund
            if ok:
                scheduled[req.request_id] = n
                budget -= n

        # 3. admit waiting requests in queue order (not in a step that preempted: it would thrash)
        may_admit = not out.preempted_request_ids
        if cfg.policy is SchedulingPolicy.STATIC and self.running:
            may_admit = False
        if may_admit and cfg.slo_deferral:
            self._defer_hopeless(now)
        held: list[Request] = []  # passed over this step, kept at the queue's front
        while may_admit and self.waiting and budget > 0:
            req = self.waiting.peek_request()
            if self._must_wait(req):
                held.append(self.waiting.pop_request())
                continue
            if len(self.running) >= cfg.max_num_seqs:
                refund = self._preempt_for(req, out, scheduled)
                if refund is None:
                    break
                budget += refund
                continue
            hit_blocks, n_hit, start = self._start_point(req)
            n = req.num_tokens - start
            if n > budget:
                if not chunked:
                    break  # head-of-line: the whole prompt must fit
                n = budget
            n = min(n, cap)
            if pace and req.num_prompt_tokens > long_prompt:
                if not grants.get(req.request_id):  # no paced tokens for it: others may pass
                    held.append(self.waiting.pop_request())
                    continue
                n = min(n, grants[req.request_id])
            if not self.kv.allocate_slots(req.request_id, start + n, hit_blocks):
                refund = self._preempt_for(req, out, scheduled)
                if refund is None:
                    break
                budget += refund
                continue
            self._start(req, start, n_hit, now)
            scheduled[req.request_id] = n
            budget -= n

        if held:
            self.waiting.prepend_requests(held)
        # decodes first, then prefill chunks, each in admission order
        items = [self._scheduled(r, scheduled[r.request_id]) for r in self.running
                 if r.request_id in scheduled]
        items.sort(key=lambda s: not s.is_decode)  # stable: admission order kept
        out.scheduled = items
        out.finished_request_ids, self._finished_ids = self._finished_ids, []
        self._fill_bitmasks(out)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    #: with pacing measured, a prompt is long (paced) when its whole prefill would add more
    #: than this many decode steps' time to a step (paced_prefill_tokens is about one): a step
    #: then stays within ~3 decode steps, the inter-token latency the decodes beside it see
    LONG_PROMPT_STEPS = 2

    def _long_prompt_tokens(self, pacing: bool) -> int:
        """Prompts longer than this are paced: the configured ``long_prompt_tokens`` (a share of
        max_model_len), or fewer where a prompt that long costs more than
        ``LONG_PROMPT_STEPS`` decode steps here (a 128-token prompt took 0.47 s beside 30 ms
        decode steps at the 1B shape on 2 cores)."""
        n = self.config.long_prompt_tokens
        return min(n, self.LONG_PROMPT_STEPS * self.paced_prefill_tokens) if pacing else n

    #: waiting requests looked at for this step's paced tokens (see _pace_grants)
    PACE_LOOKAHEAD = 64

    def _pace_grants(self, pace: int, long_prompt: int, out: SchedulerOutput,
                     scheduled: dict[str, int]) -> dict[str, int]:
        """This step's ``pace`` paced tokens, request id -> tokens: the long prompts part-way
        through their prefill and the waiting ones step 3 can start now (in the first
        ``PACE_LOOKAHEAD`` of the queue, of its front's priority, not held back, a seat and
        blocks for their share, nothing preempted this step), shortest rest first, so a short
        prompt does not wait out a long one's prefill."""
        if not pace:
            return {}
        cands = [(r.num_tokens_to_compute, 0, i, r) for i, r in enumerate(self.running)
                 if r.status is RequestStatus.RUNNING and r.request_id not in scheduled
                 and r.num_prompt_tokens > long_prompt]
        if self.waiting and not out.preempted_request_ids:
            prio = self.waiting.peek_request().priority
            for i, r in enumerate(self.waiting):
                if i >= self.PACE_LOOKAHEAD or r.priority != prio:
                    break
                if r.num_prompt_tokens > long_prompt and not self._must_wait(r):
                    cands.append((r.num_tokens - r.num_computed_tokens, 1, i, r))
        seats = self.config.max_num_seqs - len(self.running)
        free = self.kv.num_free_blocks
        grants, left = {}, pace
        for rest, waiting, _, r in sorted(cands, key=lambda c: c[:3]):
            if left <= 0:
                break
            n = min(rest, left)
            if waiting:
                need = self.kv.num_blocks_needed(r.request_id, n)
                if seats <= 0 or need > free:
                    continue
                seats, free = seats - 1, free - need
            grants[r.request_id] = n
            left -= n
        return grants

    def _admit_short_prompts(self, budget: int, out: SchedulerOutput, scheduled: dict[str, int],
                             now: float, long_prompt: int) -> int:
        """Admit the prompts of at most ``long_prompt`` tokens near the waiting queue's front
        (of its front's priority; the longer ones there keep their places) that fit whole in
        ``budget`` with a free seat and free blocks (no preemption, no chunking), in queue
        order, stopping at the first that does not; returns the budget left."""
        held: list[Request] = []
        prio = self.waiting.peek_request().priority if self.waiting else 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek_request()
            if req.priority != prio or self._must_wait(req):
                break
            if req.num_prompt_tokens > long_prompt:
                held.append(self.waiting.pop_request())
                continue
            hit_blocks, n_hit, start = self._start_point(req)
            n = req.num_tokens - start
            if n > budget or not self.kv.allocate_slots(req.request_id, start + n, hit_blocks):
                break
            self._start(req, start, n_hit, now)
            scheduled[req.request_id] = n
            budget -= n
        if held:
            self.waiting.prepend_requests(held)
        return budget

    def _start_point(self, req: Request) -> tuple[list, int, int]:
        """Where waiting ``req`` starts: (prefix-cache hit blocks, tokens they hold, first
        position to compute). The hit is the longest run of cached full blocks (none with
        caching off); a request whose KV arrived from elsewhere (num_computed_tokens > 0) looks
        up none, nor does one with prompt logprobs (they need every prompt position's logits)."""
        hit_blocks, n_hit = (self.kv.get_computed_blocks(req)
                             if req.num_computed_tokens == 0
                             and req.sampling_params.prompt_logprobs is None else ([], 0))
        return hit_blocks, n_hit, n_hit or req.num_computed_tokens

    def _start(self, req: Request, start: int, n_hit: int, now: float) -> None:
        """Move the waiting queue's front request, whose slots are allocated from ``start``
        (``n_hit`` of them prefix-cache hits), to running."""
        req.num_computed_tokens = start
        self.kv.record_query(req.num_tokens, n_hit)
        if req.num_preemptions == 0:
            req.num_cached_tokens = n_hit
        self.waiting.pop_request()
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)
        if self.connector is not None and self.connector.is_remote_decode(req):
            self.connector.update_state_after_alloc(req, self.kv.get_block_table(req.request_id),
                                                    0, now)

    def _fill_bitmasks(self, out: SchedulerOutput) -> None:
        """Set the token bitmask of every sampling request with a grammar, and note (in
        ``_broken_grammars``, for ``update_from_output``) why a request's grammar cannot go on
        and whether that is the request's own fault: (message, True) when its mask allows no
        token, not even EOS (an unsatisfiable spec: a 400), (message, False) when the matcher
        failed. Those run this step without a mask (a row with every token masked cannot be
        sampled from) and fail after it: a failure here must neither fail the step's other
        requests nor stop the engine."""
        self._broken_grammars = {}
        for sr in out.scheduled:
            r = self.requests.get(sr.request_id)
            if not sr.samples or r is None or r.grammar is None:
                continue
            try:
                mask = r.grammar.fill_bitmask()
            except Exception as e:
                self._broken_grammars[sr.request_id] = (
                    f"structured output failed: {type(e).__name__}: {e}", False)
                continue
            if not mask.strip(b"\0"):
                self._broken_grammars[sr.request_id] = (
                    "structured output: no token can continue the output under its grammar "
                    "(the spec cannot be satisfied)", True)
                continue
            sr.token_bitmask = [mask]
            if sr.spec_token_ids:
                self._mask_drafts(sr, r.grammar)

    @staticmethod
    def _mask_drafts(sr: ScheduledRequest, grammar) -> None:
        """A mask for each draft position: the matcher advances over the drafts it allows
        (the first it refuses and those after are cut from the step, as is everything after
        a draft that completes the grammar), each position's mask is filled, then the matcher
        is rolled back: ``update_from_output`` advances it over the tokens kept."""
        kept = 0
        try:
            for tok in sr.spec_token_ids:
                if not grammar.accept(tok):
                    break
                kept += 1
                if grammar.is_terminated:
                    break
                sr.token_bitmask.append(grammar.fill_bitmask())
        finally:
            grammar.rollback(kept)
        cut = len(sr.spec_token_ids) - kept
        if cut:
            sr.spec_token_ids = sr.spec_token_ids[:kept]
            sr.token_ids = sr.token_ids[:len(sr.token_ids) - cut]
            sr.num_new_tokens -= cut

    def _must_wait(self, req: Request) -> bool:
        """Not admitted this step: its grammar still compiles, or (prefix caching on) it is one
        of the ``n`` siblings of an API request whose first sibling is still prefilling the
        shared prompt: it starts once those blocks are cached, so the prompt is prefilled once
        and its full blocks are shared (reference counts) instead of computed n times."""
        g = req.grammar
        if g is not None and not getattr(g, "ready", True):
            return True
        if self.connector is not None and self.connector.is_remote_prefill(req):
            return True  # its KV comes from elsewhere (_start_kv_loads)
        if (req.parent_request_id is None or not self.kv.enable_prefix_caching
                or req.num_computed_tokens or req.num_output_tokens
                or req.sampling_params.prompt_logprobs is not None):
            return False
        full = req.num_prompt_tokens // self.kv.block_size * self.kv.block_size
        return any(r.parent_request_id == req.parent_request_id and r.num_computed_tokens < full
                   and r.num_output_tokens == 0 for r in self.running)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        """The plain-data record of `req` computing `n` query tokens from num_computed_tokens."""
        start = req.num_computed_tokens
        spec = req.spec_token_ids if n > 1 and start + 1 == req.num_tokens else []
        end = start + n - len(spec)
        targets: list[int] = []
        if req.sampling_params.prompt_logprobs is not None:
            stop = min(end, req.num_prompt_tokens - 1)  # position p predicts prompt token p + 1
            if start < stop:
                targets = req.prompt_token_ids[start + 1:stop + 1]
        return ScheduledRequest(
            request_id=req.request_id, num_computed_tokens=start, num_new_tokens=n,
            token_ids=req.token_ids_range(start, end) + spec,
            block_ids=list(self.kv.get_block_table(req.request_id)),
            sampling_params=req.sampling_params, samples=end == req.num_tokens,
            is_decode=end == req.num_tokens and end - start == 1 and req.num_output_tokens > 0,
            spec_token_ids=list(spec), prompt_logprob_targets=targets,
            num_prompt_tokens=req.num_prompt_tokens)

    # ----------------------------------------------------------------- results
    def update_from_output(self, out: SchedulerOutput, runner_out: ModelRunnerOutput,
                           now: float = 0.0) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, roll back rejected draft tokens,
        finish requests that hit a stop condition.

        Args:
            out: the SchedulerOutput this step ran.
            runner_out: its sampled tokens, one list per scheduled request in ``out`` order
                (empty for a prefill chunk that does not reach the end of the prompt; for a
                verify step of k drafts, the accepted drafts plus one: 1 to k + 1 tokens).
            now: time of the step's end (seconds), stamped on token and finish times.

        Returns:
            One output per request that got tokens or finished: finished by EOS / a stop token id
            or a completed grammar (``stop``; a grammar completes even under ``ignore_eos``: no
            token may follow), by max_tokens / max_model_len (``length``), or by a token its
            grammar refuses or a broken grammar (``abort``, with ``error``; ``bad_request`` when
            the spec cannot be satisfied), or because its logits could not be sampled
            (``runner_out.errors``: ``abort`` with that error); their blocks are already freed. Tokens sampled after
            a stop condition are dropped.

        Raises:
            ValueError: the runner output does not match the scheduler output.
        """
        if runner_out.req_ids != [s.request_id for s in out.scheduled]:
            raise ValueError("runner output is not for this scheduler output: request ids differ")
        outputs: list[EngineCoreOutput] = []
        lps = runner_out.logprobs or [None] * len(out.scheduled)
        plps = runner_out.prompt_logprobs or [None] * len(out.scheduled)
        # the worker's drafts where the core proposed placeholders (a model drafter)
        drafted = runner_out.draft_token_ids or [None] * len(out.scheduled)
        for sr, toks, lp, plp, dr in zip(out.scheduled, runner_out.sampled_token_ids, lps, plps,
                                         drafted):
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            req.num_computed_tokens += sr.num_new_tokens
            req.spec_token_ids = []
            plp = self._new_prompt_logprobs(req, sr, plp)
            if not sr.samples:
                self.kv.cache_blocks(req)
                if toks:
                    raise ValueError(f"{sr.request_id}: tokens sampled after a chunk that does "
                                     f"not reach the end of its prompt")
                if plp is not None:
                    outputs.append(EngineCoreOutput(request_id=req.request_id,
                                                    new_prompt_logprobs=plp,
                                                    parent_request_id=req.parent_request_id))
                continue
            err = runner_out.errors.get(sr.request_id) if runner_out.errors else None
            if err is not None:  # its logits could not be sampled: it fails, alone
                logger.warning("%s: %s", req.request_id, err)
                o = EngineCoreOutput(request_id=req.request_id,
                                     num_output_tokens=req.num_output_tokens,
                                     num_preemptions=req.num_preemptions,
                                     num_cached_tokens=req.num_cached_tokens,
                                     parent_request_id=req.parent_request_id)
                self._finish_output(req, RequestStatus.FINISHED_ABORTED, o, now)
                o.error = err
                outputs.append(o)
                continue
            spec = dr if dr else sr.spec_token_ids
            k = len(spec)
            if len(spec) != len(sr.spec_token_ids) or not 1 <= len(toks) <= k + 1 \
                    or toks[:-1] != spec[:len(toks) - 1]:
                raise ValueError(f"{sr.request_id}: {len(toks)} sampled tokens {toks[:4]} do "
                                 f"not fit {k} draft tokens")
            if k:  # rejected drafts: their KV is not valid; free blocks past what is kept
                req.num_computed_tokens -= k + 1 - len(toks)
            new: list[int] = []
            status = None
            broken = self._broken_grammars.get(sr.request_id)
            g = req.grammar if sr.token_bitmask else None
            why, bad_request = broken or (None, False)
            for tok in toks:
                req.output_token_ids.append(tok)
                new.append(tok)
                status = self._check_stop(req, tok)
                if g is not None:
                    if not g.accept(tok):
                        why = f"structured output: token {tok} is outside the request's grammar"
                        break
                    if g.is_terminated:
                        status = status or RequestStatus.FINISHED_STOPPED
                        break
                if status is not None:
                    break
            if why is not None:
                logger.warning("%s: %s", req.request_id, why)
                status = RequestStatus.FINISHED_ABORTED
            if k:
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                self.kv.trim(req.request_id, req.num_computed_tokens)
            self.kv.cache_blocks(req)  # before a finish frees them: freed blocks stay cached
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            o = EngineCoreOutput(request_id=req.request_id, new_token_ids=new,
                                 num_output_tokens=req.num_output_tokens,
                                 num_draft_tokens=k,
                                 num_accepted_draft_tokens=len(toks) - 1 if k else 0,
                                 num_preemptions=req.num_preemptions,
                                 num_cached_tokens=req.num_cached_tokens,
                                 parent_request_id=req.parent_request_id,
                                 new_logprobs=None if lp is None else lp.slice(0, len(new)),
                                 new_prompt_logprobs=plp)
            if status is not None:
                self._finish_output(req, status, o, now)
                if why is not None:
                    o.error, o.bad_request = why, bad_request
            outputs.append(o)
        return outputs

    # ----------------------------------------------------------------- KV connector
    def _start_kv_loads(self, now: float) -> None:
        """Cancel transfers past their deadline; give each waiting remote-prefill request, in
        queue order, the blocks of its whole prompt (its prefix-cache hits here first, with
        ``incremental``) and register its load; stop at the first that does not fit (it
        keeps its place). They take no seat and no token budget until their KV is here."""
        self.connector.expired(now)
        if not self.connector.config.is_consumer:  # a prefill instance loads nothing
            return
        incremental = self.connector.config.incremental
        for req in [r for r in self.waiting if self.connector.is_remote_prefill(r)]:
            hits, n_hit = (self.kv.get_computed_blocks(req) if incremental else ([], 0))
            n_ext, _ = self.connector.get_num_new_matched_tokens(req, n_hit)
            if not self.kv.allocate_slots(req.request_id, req.num_prompt_tokens, hits):
                break
            self.kv.record_query(req.num_tokens, n_hit)
            req.num_cached_tokens = req.num_computed_tokens = n_hit
            self.waiting.remove_request(req)
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.waiting_for_kv[req.request_id] = req
            self.connector.update_state_after_alloc(
                req, self.kv.get_block_table(req.request_id), n_ext, now)

    def update_connector_output(self, kv_out, now: float) -> list[EngineCoreOutput]:
        """Apply the connector's worker-half report (``step_io.KVConnectorOutput``): free the
        blocks of finished transfers; a request whose KV arrived takes the first token(s) the
        prefill instance sampled (an output now; it finishes if that token stops it, else its
        next step is a decode); a failed load is prefilled here (``recompute``) or fails
        (``fail``). Returns the outputs."""
        c, outs = self.connector, []
        self.kv_transfer_totals = (kv_out.bytes_sent_total, kv_out.bytes_received_total,
                                   kv_out.failures_total + c.num_timeouts)
        for rid in kv_out.finished_sending:
            if c.sent(rid):
                self.kv.free(rid)
        for rec in kv_out.finished_recving:
            if c.load_over(rec.request_id):
                self.kv.free(rec.request_id)
                continue
            req = self.waiting_for_kv.pop(rec.request_id, None)
            if req is not None:
                outs.append(self._kv_arrived(req, rec, now))
        for rid, why in kv_out.failed.items():
            prefill_side = rid in c.saving
            finished_holding = rid in c.held and rid not in self.waiting_for_kv
            if prefill_side or finished_holding:  # nothing to do but free what is held
                if c.sent(rid):
                    self.kv.free(rid)
                continue
            if rid in c.timed_out:
                why = f"no KV within timeout_s={c.config.timeout_s:g}"
            c.load_over(rid)
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue
            self.kv.free(rid)
            if c.config.kv_load_failure_policy == "recompute":
                logger.warning("%s: its KV did not arrive (%s); prefilling it here", rid, why)
                req.kv_transfer_params = None
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.prepend_request(req)
                continue
            self.requests.pop(rid, None)
            req.status = RequestStatus.FINISHED_ABORTED
            self._finished_ids.append(rid)
            outs.append(EngineCoreOutput(request_id=rid, finish_reason="abort",
                                         first_scheduled_time=req.first_scheduled_time,
                                         parent_request_id=req.parent_request_id,
                                         error=f"KV transfer failed: {why}"))
        return outs

    def _kv_arrived(self, req: Request, rec, now: float) -> EngineCoreOutput:
        """``req``'s prompt KV and first token(s) are here."""
        req.kv_transfer_params = None
        req.num_computed_tokens = rec.num_computed_tokens
        self.kv.cache_blocks(req)
        status = None
        new = []
        for tok in rec.output_token_ids:
            req.output_token_ids.append(tok)
            new.append(tok)
            status = self._check_stop(req, tok)
            if status is not None:
                break
        req.first_token_time = req.last_token_time = now
        o = EngineCoreOutput(request_id=req.request_id, new_token_ids=new,
                             num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens,
                             parent_request_id=req.parent_request_id, kv_transfer_s=rec.seconds)
        if status is not None:
            req.status = RequestStatus.WAITING  # finish_request takes it from the queue's view
            self._finish_output(req, status, o, now)
        else:
            req.status = RequestStatus.WAITING
            self.waiting.prepend_request(req)
        return o

    def _finish_output(self, req: Request, status: RequestStatus, o: EngineCoreOutput,
                       now: float) -> None:
        """Finish ``req`` (its blocks freed or, for a KV transfer, held) and say so in its
        output ``o``: the reason, the stop token, a prefill instance's ``kv_transfer_params``."""
        self.finish_request(req.request_id, status)
        req.finished_time = now
        o.finish_reason = status.finish_reason
        o.first_scheduled_time = req.first_scheduled_time
        if status is RequestStatus.FINISHED_STOPPED:
            o.stop_reason = o.new_token_ids[-1]
        o.kv_transfer_params = req.kv_transfer_out

    @staticmethod
    def _new_prompt_logprobs(req: Request, sr: ScheduledRequest, plp):
        """The prompt logprobs of this chunk not handed out before (a preempted request
        recomputes positions it already reported), or None."""
        if plp is None or not len(plp):
            return None
        skip = max(0, req.num_prompt_logprobs_done - sr.num_computed_tokens)
        req.num_prompt_logprobs_done = max(req.num_prompt_logprobs_done,
                                           sr.num_computed_tokens + len(plp))
        return plp.slice(skip) if skip < len(plp) else None

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        if (not sp.ignore_eos and tok in req.eos_token_ids) or tok in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
