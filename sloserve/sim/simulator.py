"""The discrete-event simulator: the engine's scheduler and KV cache manager, unchanged, driven
by a cost model instead of a model runner.

Time moves by events, never by sleeping: requests are admitted when their arrival time has
passed at the start of a step (as the engine admits what arrived during the previous step); a
step's duration comes from the cost model; every request whose chunk samples gets one (dummy)
token at the step's end, which is when a streaming client would see it. Prompts are token ids
of the right length (the content does not matter to scheduling); outputs run to their
``max_tokens`` (``ignore_eos``), as in a benchmark with ``--ignore-eos``.

The result is the same per-request records ``sloserve bench`` collects, so the same metrics
code, JSON and plots apply.
"""
from __future__ import annotations

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
    """

    records: list[RequestRecord]
    duration: float
    steps: list[tuple[float, StepComposition]] = field(default_factory=list)
    num_preemptions: int = 0


def simulate(requests: Sequence[SampleRequest], arrivals: Sequence[float], cfg: SimConfig,
             cost: CostModel, record_steps: bool = False) -> SimResult:
    """Simulate serving ``requests`` arriving at ``arrivals`` (s) on the engine ``cfg``.

    A request the scheduler rejects (prompt + output over ``max_model_len`` or the KV cache) is
    a failed record carrying the scheduler's message, as the server answers it with HTTP 400.

    Raises:
        ValueError: lengths of ``requests`` and ``arrivals`` differ.
        RuntimeError: the scheduler made no progress with requests pending (a bug).
    """
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      max_num_seqs=cfg.max_num_seqs,
                                      max_model_len=cfg.max_model_len, policy=cfg.policy), kv)
    n = len(requests)
    order = sorted(range(n), key=lambda i: (arrivals[i], i))
    recs = [RequestRecord(prompt_len=r.prompt_len, tag=r.tag, send_time=float(arrivals[i]))
            for i, r in enumerate(requests)]
    steps: list[tuple[float, StepComposition]] = []
    t = min(arrivals, default=0.0)
    start, k, preemptions = t, 0, 0
    while True:
        while k < n and arrivals[order[k]] <= t:
            i = order[k]
            k += 1
            r = requests[i]
            req = Request(request_id=str(i), prompt_token_ids=[0] * r.prompt_len,
                          sampling_params=SamplingParams(temperature=0.0, ignore_eos=True,
                                                         max_tokens=r.expected_output_len),
                          arrival_time=float(arrivals[i]))
            try:
                sched.add_request(req)
            except ValueError as e:
                recs[i].error = f"HTTP 400: {e}"
        if not sched.has_unfinished():
            if k == n:
                break
            t = float(arrivals[order[k]])
            continue
        out = sched.schedule(now=t)
        if out.is_empty:
            raise RuntimeError(f"the scheduler scheduled nothing at t={t:.6f} s with "
                               f"{sched.num_unfinished()} requests unfinished")
        preemptions += len(out.preempted_request_ids)
        comp = StepComposition.of(out)
        t += cost.step_time(comp)
        if record_steps:
            steps.append((t, comp))
        before = {sr.request_id: sr.request.num_output_tokens for sr in out.scheduled}
        sched.update_from_output(out, {sr.request_id: 1 for sr in out.scheduled if sr.samples}, t)
        for sr in out.scheduled:
            if sr.request.num_output_tokens > before[sr.request_id]:
                recs[int(sr.request_id)].chunk_times.append(t)
    for rec in recs:
        if rec.error:
            continue
        ct = rec.chunk_times
        rec.success = True
        rec.output_tokens = len(ct)
        rec.ttft = ct[0] - rec.send_time
        rec.latency = ct[-1] - rec.send_time
        rec.itl = [b - a for a, b in zip(ct, ct[1:])]
    end = max((r.chunk_times[-1] for r in recs if r.chunk_times), default=start)
    return SimResult(recs, max(end - start, 1e-9), steps, preemptions)
