"""The discrete-event simulator: the engine's scheduler and KV cache manager, unchanged, driven
by a cost model instead of a model runner.

Time moves by events, never by sleeping: requests are admitted when their arrival time has
passed at the start of a step (as the engine admits what arrived during the previous step); a
step's duration comes from the cost model; every request whose chunk samples gets one (dummy)
token at the step's end, which is when a streaming client would see it. Prompts are token ids
of the right length (the content does not matter to scheduling); outputs run to their
``max_tokens`` (``ignore_eos``), as in a benchmark with ``--ignore-eos``.

The result is the same per-request records ``sloserve bench`` collects, so the same metrics
code, JSON and plots apply. ``simulate_cluster`` runs several replicas behind a router;
``find_capacity`` searches the highest request rate that meets an SLO.
"""
from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass, field
from typing import Sequence

from sloserve.bench.datasets import SampleRequest
from sloserve.bench.request_func import RequestRecord
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.request import Request
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.sampling_params import SamplingParams
from sloserve.sim.cost_model import CostModel, StepComposition


@dataclass
class SimConfig:
    """The simulated engine (same meaning as the ``sloserve serve`` flags).

    Attributes:
        max_num_batched_tokens, max_num_seqs, max_model_len, policy: the scheduler's settings.
        num_kv_blocks, block_size: the KV cache.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    policy: str = "chunked"
    num_kv_blocks: int = 4096
    block_size: int = 16


@dataclass
class SimResult:
    """A finished simulation.

    Attributes:
        records: one per request, in input order; times in simulated seconds from 0.
        duration: first arrival to the last token (s).
        steps: (end time, composition) of every step, when recorded.
        num_preemptions: preemptions over the run.
        replica_of: the replica each request was routed to, in input order.
    """

    records: list[RequestRecord]
    duration: float
    steps: list[tuple[float, StepComposition]] = field(default_factory=list)
    num_preemptions: int = 0
    replica_of: list[int] = field(default_factory=list)


class Replica:
    """One simulated engine: its own scheduler and KV cache, busy from a step's start to its end."""

    def __init__(self, index: int, cfg: SimConfig, cost: CostModel, requests: Sequence[SampleRequest],
                 recs: list[RequestRecord], record_steps: bool):
        self.index, self.cost, self.requests, self.recs = index, cost, requests, recs
        self.sched = Scheduler(SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len, policy=cfg.policy),
            KVCacheManager(cfg.num_kv_blocks, cfg.block_size))
        self.inbox: list[int] = []
        self.running_step = None
        self.steps: list[tuple[float, StepComposition]] = []
        self.record_steps = record_steps
        self.preemptions = 0

    @property
    def busy(self) -> bool:
        return self.running_step is not None

    @property
    def outstanding(self) -> int:
        """Requests routed here and not finished (queued, running or in the inbox)."""
        return self.sched.num_unfinished + len(self.inbox)

    def admit(self, arrivals: Sequence[float]) -> None:
        """Hand the inbox to the scheduler (a rejected request becomes a failed record)."""
        for i in self.inbox:
            r = self.requests[i]
            req = Request(request_id=str(i), prompt_token_ids=[0] * r.prompt_len,
                          sampling_params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                         max_tokens=r.expected_output_len),
                          arrival_time=float(arrivals[i]))
            try:
                self.sched.add_request(req)
            except ValueError as e:
                self.recs[i].error = f"HTTP 400: {e}"
        self.inbox.clear()

    def start(self, t: float) -> float | None:
        """Schedule a step at ``t``; returns its end time, or None when there is nothing to run.

        Raises:
            RuntimeError: work is pending but the scheduler scheduled nothing.
        """
        if not self.sched.has_unfinished():
            return None
        out = self.sched.schedule(now=t)
        if out.is_empty:
            raise RuntimeError(f"replica {self.index}: the scheduler scheduled nothing at "
                               f"t={t:.6f} s with {self.sched.num_unfinished} requests unfinished")
        self.preemptions += len(out.preempted_request_ids)
        comp = StepComposition.of(out)
        end = t + self.cost.step_time(comp)
        self.running_step = out
        if self.record_steps:
            self.steps.append((end, comp))
        return end

    def complete(self, t: float) -> None:
        """End the running step at ``t``: advance the requests, stamp the emitted tokens."""
        out, self.running_step = self.running_step, None
        before = {sr.request_id: sr.request.num_output_tokens for sr in out.scheduled}
        self.sched.update_from_output(out, {sr.request_id: 1 for sr in out.scheduled if sr.samples}, t)
        for sr in out.scheduled:
            if sr.request.num_output_tokens > before[sr.request_id]:
                self.recs[int(sr.request_id)].chunk_times.append(t)


ROUTERS = ("round-robin", "least-outstanding", "prefix-affinity")


def _route(policy: str, replicas: list[Replica], req: SampleRequest, counter: int) -> Replica:
    if policy == "round-robin":
        return replicas[counter % len(replicas)]
    if policy == "prefix-affinity" and req.tag is not None:
        return replicas[zlib.crc32(req.tag.encode()) % len(replicas)]
    return min(replicas, key=lambda r: (r.outstanding, r.index))


def simulate_cluster(requests: Sequence[SampleRequest], arrivals: Sequence[float], cfg: SimConfig,
                     cost: CostModel, num_replicas: int = 1, router: str = "least-outstanding",
                     record_steps: bool = False) -> SimResult:
    """Simulate ``num_replicas`` engines ``cfg`` behind a router.

    Routers: ``round-robin``; ``least-outstanding`` (fewest unfinished requests, ties to the
    lowest index); ``prefix-affinity`` (requests with the same workload tag, e.g. a
    ``shared-prefix`` group, always to the same replica, by a stable hash; untagged ones as
    least-outstanding). Events are processed in time order; an arrival at the same instant as a
    step's end is admitted before the next step, as the engine does.

    Raises:
        ValueError: lengths differ, num_replicas < 1, unknown router.
        RuntimeError: a scheduler made no progress with requests pending (a bug).
    """
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    n = len(requests)
    order = sorted(range(n), key=lambda i: (arrivals[i], i))
    recs = [RequestRecord(prompt_len=r.prompt_len, tag=r.tag, send_time=float(arrivals[i]))
            for i, r in enumerate(requests)]
    reps = [Replica(j, cfg, cost, requests, recs, record_steps) for j in range(num_replicas)]
    heap: list[tuple[float, int]] = []
    replica_of = [0] * n
    k = 0
    inf = float("inf")
    while k < n or heap:
        t_arr = float(arrivals[order[k]]) if k < n else inf
        t_done = heap[0][0] if heap else inf
        if t_arr <= t_done:
            while k < n and arrivals[order[k]] <= t_arr:
                i = order[k]
                rep = _route(router, reps, requests[i], k)
                rep.inbox.append(i)
                replica_of[i] = rep.index
                k += 1
            for r in reps:
                if not r.busy and r.inbox:
                    r.admit(arrivals)
                    end = r.start(t_arr)
                    if end is not None:
                        heapq.heappush(heap, (end, r.index))
        else:
            t, j = heapq.heappop(heap)
            r = reps[j]
            r.complete(t)
            r.admit(arrivals)
            end = r.start(t)
            if end is not None:
                heapq.heappush(heap, (end, j))
    for rec in recs:
        if rec.error:
            continue
        rec.success = True
        rec.output_tokens = len(rec.chunk_times)
        rec.set_times_from_chunks()
    start = min(arrivals, default=0.0)
    end = max((r.chunk_times[-1] for r in recs if r.chunk_times), default=start)
    steps = sorted((s for r in reps for s in r.steps), key=lambda s: s[0])
    return SimResult(recs, max(end - start, 1e-9), steps, sum(r.preemptions for r in reps),
                     replica_of)


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
