"""The discrete-event simulator: the engine core itself (``EngineCore``, with its scheduler and
KV cache manager, unchanged) over a cost-model executor and a virtual clock.

Time moves by events, never by sleeping. Each replica is an ``EngineCore`` whose executor
(:class:`~sloserve.sim.executor.CostModelExecutor`) prices a step with the cost model and
advances the replica's :class:`~sloserve.sim.executor.VirtualClock` by it. A step is taken
whole when an idle replica starts it (schedule, the priced "forward", update: the core's own
``step``), and its outputs are delivered at its end, which is when a streaming client would see
the tokens; until then the router counts the requests it finishes as still outstanding.
Requests that reach a replica while its step runs are added when the step ends, as the real
single-threaded core loop takes its inputs between steps. Prompts are token ids of the right
length (the content does not matter to scheduling); outputs run to their ``max_tokens``
(``ignore_eos``), as in a benchmark with ``--ignore-eos``. With speculative decoding
(``SimConfig.speculative``) a step may give a request several tokens: its record counts the
tokens (``output_tokens``, so TPOT is per token) and the step's tokens arrive together, one
content chunk (one inter-token gap per step, as the server streams a multi-token delta as one
event and ``sloserve bench`` times events).

The result is the same per-request records ``sloserve bench`` collects, so the same metrics
code, JSON and plots apply. ``simulate_cluster`` runs several replicas behind a router;
``find_capacity`` searches the highest request rate that meets an SLO.
"""
from __future__ import annotations

import enum
import heapq
import math
import zlib
from dataclasses import dataclass, field
from typing import Sequence

from sloserve.config import EngineConfig, SpeculativeConfig
from sloserve.engine.admission import AdmissionLimits, check_arrival
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, KVTransferParams
from sloserve.engine.scheduler import SchedulerConfig, SchedulingPolicy
from sloserve.sampling_params import SamplingParams
from sloserve.sim.cost_model import CostModel, StepComposition
from sloserve.sim.executor import (MAX_STEP_S, SAMPLED_TOKEN_ID, CostModelExecutor, SimDrafter,
                                   VirtualClock, verify_cost)
from sloserve.sim.kv_transfer import Disaggregation, KVNetwork
from sloserve.workload import PREFIX_GROUP_TAG, RequestRecord, SampleRequest

__all__ = ["MAX_STEP_S", "ROUTERS", "Replica", "SimConfig", "SimResult", "find_capacity",
           "simulate", "simulate_cluster"]


@dataclass
class SimConfig(SchedulerConfig):
    """The simulated engine: the scheduler's own settings (inherited, with the engine's
    defaults) plus the KV cache and the server's path.

    Attributes:
        max_num_batched_tokens, max_num_seqs, max_model_len, policy: see SchedulerConfig.
        num_kv_blocks: KV blocks per instance (default: what ``--kv-cache-memory``'s default
            holds for the embedded SmolLM2 in bf16, :func:`sloserve.sim.capacity.kv_blocks`).
        block_size: tokens per KV block (the engine's default).
        request_in_s: the server's path from a client's send to the engine's queue (HTTP,
            validation, tokenization), seconds; measured by ``sloserve profile --from-trace
            ... --bench-result``.
        token_out_s: from the end of the step that made a token to the client holding it
            (detokenization, the SSE event), seconds.
        enable_prefix_caching: the engine's prefix cache (its own code; prompts are stand-in
            token ids that share where the workload's texts share, see ``Replica.token_ids``).
        max_waiting_requests, slo_reject (with ttft_slo_s): the server's overload control at
            arrival (``sloserve.engine.admission``, the same rules): a refused request is a
            failed record with the server's 429 message.
        speculative: speculative decoding (``--speculative-config``), modelled: the engine's
            drafter rules with stand-in drafts (:class:`~sloserve.sim.executor.SimDrafter`);
            None: off.
        spec_acceptance_rate: the chance a draft token is accepted given that every earlier
            draft of its step was (0 to 1).
        seed: seeds the acceptance draws (each replica its own stream).
    """

    num_kv_blocks: int | None = None
    block_size: int = EngineConfig.block_size
    request_in_s: float = 0.0
    token_out_s: float = 0.0
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    max_waiting_requests: int | None = None
    slo_reject: bool = False
    speculative: SpeculativeConfig | None = None
    spec_acceptance_rate: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.spec_acceptance_rate, (int, float))
                and 0 <= self.spec_acceptance_rate <= 1):
            raise ValueError(f"the draft acceptance rate must be in [0, 1], got "
                             f"{self.spec_acceptance_rate!r}")
        if self.num_kv_blocks is None:
            from sloserve.sim.capacity import kv_blocks
            self.num_kv_blocks = kv_blocks(EngineConfig.kv_cache_memory, "SmolLM2-135M", "bf16",
                                           self.block_size)

    def engine_config(self) -> EngineConfig:
        """The simulated core's settings: its cache and batching as this config has them
        (the scheduler itself runs on this config; overload control is the front end's, here
        the simulator's)."""
        return EngineConfig(block_size=self.block_size, num_kv_blocks=self.num_kv_blocks,
                            enable_prefix_caching=self.enable_prefix_caching,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_num_seqs=self.max_num_seqs, scheduling_policy=self.queue_policy,
                            enable_chunked_prefill=self.policy is not SchedulingPolicy.NAIVE,
                            static_batching=self.policy is SchedulingPolicy.STATIC,
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            enable_prefill_pacing=self.enable_prefill_pacing)


@dataclass
class SimResult:
    """A finished simulation.

    Attributes:
        records: one per request, in input order; times in simulated seconds from 0.
        duration: first arrival to the last token (s).
        steps: (end time, composition) of every step, when recorded.
        num_preemptions: preemptions over the run.
        replica_of: the replica each request was routed to, in input order (with
            disaggregation: its prefill instance; decode instances are numbered after them).
        mean_in_flight: requests sent and not finished, averaged over ``duration`` (Little's L).
        kv_transfer_s: exposed KV-transfer seconds of each request, in input order: from the
            end of its prefill until its KV is at the decode instance, sharing the link
            included (0 for one that finished on its prefill instance; empty without
            disaggregation).
        num_drafts, num_draft_tokens, num_accepted_tokens: speculative decoding over the run,
            as the server's ``/metrics`` counts them (verify steps of a request, draft tokens,
            accepted draft tokens).
    """

    records: list[RequestRecord]
    duration: float
    steps: list[tuple[float, StepComposition]] = field(default_factory=list)
    num_preemptions: int = 0
    replica_of: list[int] = field(default_factory=list)
    mean_in_flight: float = 0.0
    kv_transfer_s: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def spec_summary(self) -> str:
        """vLLM's figures of the drafts: acceptance (accepted / draft tokens) and mean
        acceptance length (1 + accepted per verify); "" when there were none."""
        if not self.num_draft_tokens:
            return ""
        return (f"drafts: {self.num_draft_tokens} tokens in {self.num_drafts} verifies, "
                f"acceptance {100 * self.num_accepted_tokens / self.num_draft_tokens:.1f} %, "
                f"mean acceptance length {1 + self.num_accepted_tokens / self.num_drafts:.2f}")


class Replica:
    """One simulated engine: an :class:`~sloserve.engine.core.EngineCore` over a
    :class:`~sloserve.sim.executor.CostModelExecutor` on its own virtual clock, busy from a
    step's start to its end.

    ``role``: ``both`` (colocated), ``prefill`` (runs a request until its first token, then
    hands it off) or ``decode`` (takes requests whose prompt KV arrived over the link).

    A prefill instance keeps a handed-off request's KV blocks until its transfer has finished
    (:meth:`release`), with no change to the engine: in the step that samples the request's
    first token, before the core's update finishes it and frees its blocks, the executor's
    ``on_execute`` lets the replica add one reference to each of them (the pool's ``incref``,
    as a second holder of a shared prefix block does), so the scheduler's free leaves them
    held, still serving prefix-cache hits, and the scheduler sees that many fewer free
    blocks; :meth:`release` drops the reference. A prefill instance whose waiting requests
    find no free blocks then idles (``stalled``) until a transfer ends.
    """

    def __init__(self, index: int, cfg: SimConfig, cost: CostModel, requests: Sequence[SampleRequest],
                 recs: list[RequestRecord], record_steps: bool, role: str = "both"):
        self.index, self.requests, self.recs, self.role = index, requests, recs, role
        self.token_out_s = cfg.token_out_s
        self.clock = VirtualClock()
        self.steps: list[tuple[float, StepComposition]] = []
        executor = CostModelExecutor(cfg.engine_config(), cost, self.clock, cfg.max_model_len,
                                     on_step=self._record_step if record_steps else None,
                                     spec_acceptance_rate=cfg.spec_acceptance_rate,
                                     seed=cfg.seed * 1_000_003 + index,
                                     on_execute=self._on_execute if role == "prefill" else None)
        self.core = EngineCore(executor.config, executor, scheduler_config=cfg, clock=self.clock,
                               raise_step_errors=True)
        if cfg.speculative is not None:
            self.core.drafter = SimDrafter(
                cfg.speculative, executor.get_model_info().quantized_step_max_tokens,
                verify_cost(cost))
        self.num_drafts = self.num_draft_tokens = self.num_accepted = 0
        self.inbox: list[int] = []
        self.incoming = 0  # KV transfers on their way here
        #: the step in flight: the core took it at its start; its outputs are delivered at its end
        self.running: EngineCoreOutputs | None = None
        self.num_finishing = 0  # requests the step in flight finishes
        self.preemptions = 0
        self.limits = AdmissionLimits(cfg.max_waiting_requests, cfg.ttft_slo_s, cfg.slo_reject)
        #: prefill: the blocks held for each request whose KV is on its way (request -> blocks)
        self.held: dict[int, list[int]] = {}
        #: prefill: the prompt chunks of the step in flight of the requests it hands off:
        #: (request, tokens computed before, tokens computed after, step start, step end)
        self.chunks: list[tuple[int, int, int, float, float]] = []
        #: prefill: requests wait for blocks that transfers hold (retried at a release or an
        #: arrival, not at every event)
        self.stalled = False

    def _record_step(self, end: float, comp: StepComposition) -> None:
        self.steps.append((end, comp))

    def _on_execute(self, out, start: float, end: float) -> None:
        """A prefill step is priced: note its chunks of requests that will be handed off and
        hold the blocks of those it finishes (see the class docstring)."""
        for sr in out.scheduled:
            i = int(sr.request_id)
            if sr.is_decode or self.requests[i].expected_output_len <= 1:
                continue
            self.chunks.append((i, sr.num_computed_tokens, sr.end_pos, start, end))
            if sr.samples:  # its first token: the update finishes it
                self.core.kv.pool.incref(sr.block_ids)
                self.held[i] = list(sr.block_ids)

    def release(self, i: int) -> None:
        """Request ``i``'s KV has reached its decode instance: its blocks here are let go."""
        self.core.kv.pool.free(reversed(self.held.pop(i)))
        self.stalled = False

    @staticmethod
    def token_ids(r: SampleRequest, index: int) -> list[int]:
        """Stand-in token ids of request ``index``'s prompt, ``prompt_len`` of them: one id per
        word (the number of a placeholder word ``w123``, else the word's CRC-32), so prompts
        share cached blocks exactly where their texts share words; positions past the text's
        words get ids of this request alone (negative), so an unknown tail is never shared."""
        ids = []
        for w in r.prompt.split()[:r.prompt_len]:
            ids.append(int(w[1:]) if w[:1] == "w" and w[1:].isdigit() else zlib.crc32(w.encode()))
        base = -1 - (index << 32)
        ids.extend(base - p for p in range(len(ids), r.prompt_len))
        return ids

    @property
    def busy(self) -> bool:
        return self.running is not None

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished (queued, running, finishing in the step in
        flight, in the inbox or on the way)."""
        return (self.core.scheduler.num_unfinished + self.num_finishing + len(self.inbox)
                + self.incoming)

    def admit(self, sent: Sequence[float], now: float) -> list[int]:
        """Hand the inbox to the core at ``now`` (s, between steps); returns the requests it
        rejected (each becomes a failed record with the server's 400 or 429 message)."""
        rejected = []
        for i in self.inbox:
            r = self.requests[i]
            if self.role != "decode" and self.limits.active:
                rej = check_arrival(self.limits, self.core.stats(), r.prompt_len,
                                    wait_s=max(0.0, now - float(sent[i])))
                if rej is not None:
                    self.recs[i].error = f"HTTP 429: {rej.message}"
                    rejected.append(i)
                    continue
            kv = None
            if self.role == "prefill":  # checked whole, run to its first token only
                kv = KVTransferParams(do_remote_decode=True)
            elif self.role == "decode":  # the prompt's KV and the first token came from prefill
                kv = KVTransferParams(num_computed_tokens=r.prompt_len,
                                      output_token_ids=[SAMPLED_TOKEN_ID])
            try:
                self.core.add_request(EngineCoreRequest(
                    request_id=str(i), prompt_token_ids=self.token_ids(r, i),
                    sampling_params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                   max_tokens=r.expected_output_len),
                    arrival_time=float(sent[i]), kv_transfer_params=kv,
                    priority=r.priority))
            except ValueError as e:  # the core checks the whole request, here as on a server
                self.recs[i].error = f"HTTP 400: {e}"
                rejected.append(i)
        self.stalled = self.stalled and not self.inbox
        self.inbox.clear()
        return rejected

    def start(self, t: float) -> float | None:
        """Have the core take a step at ``t``; returns the step's end time, or None when there
        is nothing to run (or, on a prefill instance, nothing fits beside the blocks its
        transfers hold: ``stalled`` until one ends or a request arrives).

        Raises:
            RuntimeError: work is pending but the scheduler scheduled nothing (and no
                transfer holds blocks here).
            ValueError: the cost model priced the step out of range (``MAX_STEP_S``).
        """
        if not self.core.has_unfinished_requests() or self.stalled:
            return None
        self.clock.set(t)
        outs = self.core.step()
        if (outs is None or outs.step is None) and self.held:  # blocks held for transfers
            self.stalled = True
            return None
        if outs is None or outs.step is None:
            raise RuntimeError(f"replica {self.index}: the scheduler scheduled nothing at "
                               f"t={t:.6f} s with {self.core.scheduler.num_unfinished} requests "
                               f"unfinished")
        self.preemptions += outs.step.num_preemptions
        self.running = outs
        self.num_finishing = sum(1 for o in outs.outputs if o.finished)
        return outs.timestamp

    def complete(self) -> list[int]:
        """End the step in flight: stamp the tokens it made (the client has each
        ``token_out_s`` after the step's end).

        Returns:
            The index of each request that finished here.
        """
        outs, self.running, self.num_finishing = self.running, None, 0
        t = outs.timestamp + self.token_out_s
        for o in outs.outputs:
            if o.new_token_ids:  # the step's tokens of a request: one chunk
                rec = self.recs[int(o.request_id)]
                rec.chunk_times.append(t)
                rec.output_tokens += len(o.new_token_ids)
            if o.num_draft_tokens:
                self.num_drafts += 1
                self.num_draft_tokens += o.num_draft_tokens
                self.num_accepted += o.num_accepted_draft_tokens
        return [int(o.request_id) for o in outs.outputs if o.finished]

    def close(self) -> None:
        self.core.close()


ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity")


def _route(policy: str, replicas: Sequence[Replica], req: SampleRequest, counter: int) -> Replica:
    if policy == "round-robin":
        return replicas[counter % len(replicas)]
    if policy == "prefix-affinity" and req.tag is not None and req.tag.startswith(PREFIX_GROUP_TAG):
        return replicas[zlib.crc32(req.tag.encode()) % len(replicas)]
    return min(replicas, key=lambda r: (r.outstanding, r.index))


class EventKind(enum.Enum):
    """What happens at an event's time."""

    STEP_END = "step end"                   # a replica's running step finishes
    REACHES_ENGINE = "reaches engine"       # a request arrives in a replica's queue (through
                                            # the server path, or its KV over the link)
    CLIENT_HAS_LAST = "client has last"     # the client got a request's last token


@dataclass(order=True)
class Event:
    """One entry of the event heap, ordered by (time, seq); seq keeps insertion order."""

    time: float
    seq: int
    kind: EventKind = field(compare=False)
    replica: int = field(compare=False, default=-1)
    request: int = field(compare=False, default=-1)


def simulate_cluster(requests: Sequence[SampleRequest], arrivals: Sequence[float], cfg: SimConfig,
                     cost: CostModel, num_replicas: int = 1, router: str = "least-outstanding",
                     record_steps: bool = False, max_concurrency: int | None = None,
                     disaggregation: Disaggregation | None = None) -> SimResult:
    """Simulate ``num_replicas`` engines ``cfg`` behind a router.

    Routers: ``round-robin``; ``least-outstanding`` (fewest unfinished requests, ties to the
    lowest index); ``prefix-affinity`` (the requests of one ``shared-prefix`` group, tagged
    ``group<N>``, always to the same replica, by a stable hash; others as least-outstanding). Events are processed in time order; an arrival at the same instant as a
    step's end is admitted before the next step, as the engine does.

    ``max_concurrency`` closes the loop as ``sloserve bench --max-concurrency`` does: a request
    is sent at its arrival time or, when that many are in flight, when one finishes; its wait is
    its ``queue_time`` and its TTFT counts from the send.

    ``cfg.request_in_s`` delays each request between its send and the engine's queue;
    ``cfg.token_out_s`` delays every token between its step's end and the client (the
    closed loop frees a slot when the client has the last token, as the bench client does).

    ``disaggregation`` replaces the replicas by P prefill and D decode instances: a request is
    routed (``router``) to a prefill instance and runs there until its first token (TTFT), then
    its prompt KV crosses the link to the least-outstanding decode instance (chosen when the
    transfer starts: at the prefill's end for ``eager``, at its first chunk for
    ``layerwise``), which admits it with the KV in place when the last byte has arrived (plus
    the link's latency) and decodes the rest; the transfer shows as the first inter-token gap.
    Transfers share the instances' NICs (:class:`~sloserve.sim.kv_transfer.KVNetwork`:
    processor sharing, max-min fair). The prefill instance holds the request's KV blocks until
    the KV has arrived (:class:`Replica`), so a slow link fills its cache and delays its
    admissions; the decode instance takes blocks for it when it admits it, at arrival.

    Raises:
        ValueError: lengths differ, num_replicas < 1, unknown router, max_concurrency < 1, a
            server-path delay that is negative or not finite, a step priced at <= 0 s, over
            :data:`MAX_STEP_S` or NaN.
        RuntimeError: a scheduler made no progress with requests pending (a bug).
    """
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    for name, v in (("request_in_s", cfg.request_in_s), ("token_out_s", cfg.token_out_s)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {v}")
    return _Cluster(requests, arrivals, cfg, cost, num_replicas, router, record_steps,
                    max_concurrency, disaggregation).run()


class _Cluster:
    """The event loop of :func:`simulate_cluster` (one run)."""

    def __init__(self, requests, arrivals, cfg: SimConfig, cost, num_replicas, router,
                 record_steps, max_concurrency, dis: Disaggregation | None):
        self.requests, self.arrivals, self.cfg = requests, arrivals, cfg
        self.router, self.max_concurrency, self.dis = router, max_concurrency, dis
        n = len(requests)
        self.order = sorted(range(n), key=lambda i: (arrivals[i], i))
        self.recs = [RequestRecord(prompt_len=r.prompt_len, tag=r.tag, send_time=float(arrivals[i]))
                     for i, r in enumerate(requests)]
        if dis is None:
            self.front = [Replica(j, cfg, cost, requests, self.recs, record_steps)
                          for j in range(num_replicas)]
            self.back: list[Replica] = []
        else:
            self.front = [Replica(j, cfg, cost, requests, self.recs, record_steps, "prefill")
                          for j in range(dis.num_prefill)]
            self.back = [Replica(dis.num_prefill + j, cfg, cost, requests, self.recs,
                                 record_steps, "decode") for j in range(dis.num_decode)]
        self.reps = self.front + self.back
        self.heap: list[Event] = []
        self.seq = 0
        self.replica_of = [0] * n
        self.sent = [float(a) for a in arrivals]
        self.transfer_s = [0.0] * n if dis is not None else []
        self.net = KVNetwork(dis) if dis is not None else None
        self.dest: dict[int, Replica] = {}   # decode instance of each transfer started
        self.prefill_end: dict[int, float] = {}
        self.k = 0           # requests sent so far (in arrival order)
        self.in_flight = 0   # sent and not yet fully received by the client
        self.now = 0.0
        self.area = 0.0      # integral of in_flight over time (Little's L)

    def _push(self, t: float, kind: EventKind, replica: int = -1, request: int = -1) -> None:
        heapq.heappush(self.heap, Event(t, self.seq, kind, replica, request))
        self.seq += 1

    def _may_send(self) -> bool:
        return self.k < len(self.requests) and (
            self.max_concurrency is None or self.in_flight < self.max_concurrency)

    def run(self) -> SimResult:
        inf = float("inf")
        try:
            while True:
                t_send = max(float(self.arrivals[self.order[self.k]]), self.now) \
                    if self._may_send() else inf
                t_ev = self.heap[0].time if self.heap else inf
                t_net = self.net.next_time() if self.net is not None else inf
                t = min(t_send, t_ev, t_net)
                if t == inf:
                    break
                self.area += self.in_flight * (t - self.now)
                self.now = t
                if self.net is not None:
                    for i, sent in self.net.advance(t):
                        self._kv_sent(i, sent)
                if t_ev < t_send and t_ev == t:
                    self._handle(heapq.heappop(self.heap))
                self._send_due()
                self._start_idle()
        finally:
            for r in self.reps:
                r.close()
        return self._result()

    def _handle(self, ev: Event) -> None:
        if ev.kind is EventKind.CLIENT_HAS_LAST:  # its slot is free
            self.in_flight -= 1
        elif ev.kind is EventKind.REACHES_ENGINE:
            r = self.reps[ev.replica]
            r.incoming -= 1
            r.inbox.append(ev.request)
            if r.role == "decode":  # its KV arrived: the prefill instance lets it go
                self.front[self.replica_of[ev.request]].release(ev.request)
        else:
            self._step_end(self.reps[ev.replica])

    def _step_end(self, r: Replica) -> None:
        """A replica's step ended: its finished requests leave it (to the client, or with
        disaggregation from a prefill instance over the KV link to a decode instance)."""
        for i in r.complete():
            if r.role != "prefill" or self.requests[i].expected_output_len <= 1:
                if self.cfg.token_out_s > 0:
                    self._push(self.now + self.cfg.token_out_s, EventKind.CLIENT_HAS_LAST,
                               request=i)
                else:
                    self.in_flight -= 1
                continue
            if i not in self.dest:  # eager: the transfer starts now
                self._start_transfer(r, i)
            self.prefill_end[i] = self.now
            self.net.prefill_done(i)

    def _start_transfer(self, r: Replica, i: int) -> None:
        """Request ``i``'s KV starts from prefill instance ``r`` to the least-outstanding
        decode instance."""
        d = min(self.back, key=lambda b: (b.outstanding, b.index))
        d.incoming += 1
        self.dest[i] = d
        self.net.start(i, r.index, d.index - len(self.front), self.requests[i].prompt_len)

    def _prefill_chunks(self, r: Replica) -> None:
        """``layerwise``: the KV of the chunks of the step prefill instance ``r`` just started
        is sent as it is computed (a prompt's transfer starts at its first chunk, with its
        prefix-cache hits sendable at once)."""
        chunks, r.chunks = r.chunks, []
        if self.dis.link.mode != "layerwise":
            return
        for i, before, after, start, end in chunks:
            if i not in self.dest:
                self._start_transfer(r, i)
            self.net.produced(i, before, after, start, end)

    def _kv_sent(self, i: int, t: float) -> None:
        """Request ``i``'s last byte left at ``t``: its KV is at the decode instance after the
        link's latency."""
        arrival = t + self.dis.link.latency_s
        self.transfer_s[i] = arrival - self.prefill_end.pop(i)
        self._push(arrival, EventKind.REACHES_ENGINE, self.dest.pop(i).index, i)

    def _send_due(self) -> None:
        """Send what is due (arrivals at or before now, while the concurrency limit allows)."""
        while self._may_send() and self.arrivals[self.order[self.k]] <= self.now:
            i = self.order[self.k]
            self.sent[i] = self.now if self.max_concurrency is not None else float(self.arrivals[i])
            rep = _route(self.router, self.front, self.requests[i], self.k)
            if self.cfg.request_in_s > 0:
                rep.incoming += 1
                self._push(self.now + self.cfg.request_in_s, EventKind.REACHES_ENGINE, rep.index, i)
            else:
                rep.inbox.append(i)
            self.replica_of[i] = rep.index
            self.in_flight += 1
            self.k += 1

    def _start_idle(self) -> None:
        for r in self.reps:
            if not r.busy and r.inbox:
                self.in_flight -= len(r.admit(self.sent, self.now))
            if not r.busy:
                end = r.start(self.now)
                if end is not None:
                    self._push(end, EventKind.STEP_END, r.index)
                    if r.chunks:
                        self._prefill_chunks(r)

    def _result(self) -> SimResult:
        for i, rec in enumerate(self.recs):
            rec.send_time = self.sent[i]
            rec.queue_time = self.sent[i] - float(self.arrivals[i])
            if rec.error:
                continue
            rec.success = True
            rec.set_times_from_chunks()  # output_tokens: counted as the tokens came
        start = min(self.arrivals, default=0.0)
        end = max((r.chunk_times[-1] for r in self.recs if r.chunk_times), default=start)
        duration = max(end - start, 1e-9)
        steps = sorted((s for r in self.reps for s in r.steps), key=lambda s: s[0])
        return SimResult(self.recs, duration, steps, sum(r.preemptions for r in self.reps),
                         self.replica_of, self.area / duration, self.transfer_s,
                         sum(r.num_drafts for r in self.reps),
                         sum(r.num_draft_tokens for r in self.reps),
                         sum(r.num_accepted for r in self.reps))


def simulate(requests: Sequence[SampleRequest], arrivals: Sequence[float], cfg: SimConfig,
             cost: CostModel, record_steps: bool = False) -> SimResult:
    """Simulate serving ``requests`` arriving at ``arrivals`` (s) on one engine ``cfg``.

    A request the scheduler rejects (prompt + output over ``max_model_len`` or the KV cache) is
    a failed record carrying the scheduler's message, as the server answers it with HTTP 400.

    Raises:
        ValueError: lengths of ``requests`` and ``arrivals`` differ.
        RuntimeError: the scheduler made no progress with requests pending (a bug).
    """
    return simulate_cluster(requests, arrivals, cfg, cost, 1, record_steps=record_steps)


def find_capacity(run_at_rate, meets, lo: float, hi: float, iters: int = 12) -> float | None:
    """The highest rate in [lo, hi] at which ``meets(run_at_rate(rate))`` holds, by bisection
    (assumes that meeting the SLO is monotone in the rate, as it is once queues build).

    Args:
        run_at_rate: rate (req/s) -> metrics of a simulated run at that rate.
        meets: metrics -> bool.
        lo, hi: search range (req/s), 0 < lo < hi.
        iters: bisection steps (the answer is within (hi - lo) / 2**iters).

    Returns:
        The rate, or None when even ``lo`` misses the SLO.

    Raises:
        ValueError: not 0 < lo < hi.
    """
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got {lo}, {hi}")
    if not meets(run_at_rate(lo)):
        return None
    if meets(run_at_rate(hi)):
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if meets(run_at_rate(mid)):
            lo = mid
        else:
            hi = mid
    return lo
