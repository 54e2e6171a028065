"""Property-based tests: random workloads driven to completion with fake sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloserve.engine.kv_cache_manager import cdiv
from sloserve.engine.request import RequestStatus
from sloserve.step_io import ModelRunnerOutput

from .conftest import (check_kv_invariants, expected_outputs, fake_token, make_request,
                       make_scheduler)

MAX_MODEL_LEN = 64


@dataclass
class Spec:
    prompt_len: int
    max_tokens: int
    arrival: int                 # step before which it is added
    abort_at: int | None         # step at which it is aborted (if still unfinished)
    abort_mid_step: bool         # abort between schedule() and update_from_output()
    eos_at: int | None = None    # output index at which the fake model samples EOS


@st.composite
def request_specs(draw, with_eos: bool = False):
    prompt_len = draw(st.integers(1, 40))
    max_tokens = draw(st.integers(1, min(24, MAX_MODEL_LEN - prompt_len)))
    arrival = draw(st.integers(0, 12))
    abort_at = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 40)))
    eos_at = draw(st.one_of(st.none(), st.integers(0, 30))) if with_eos else None
    return Spec(prompt_len, max_tokens, arrival, abort_at, draw(st.booleans()), eos_at)


@st.composite
def workloads(draw, with_eos: bool = False):
    policy = draw(st.sampled_from(["chunked", "naive", "static"]))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    specs = draw(st.lists(request_specs(with_eos), min_size=1, max_size=8))
    # the pool always holds the largest request alone (prompt + max_tokens), plus a small
    # random slack, so preemption is frequent but every request can complete
    need = max(cdiv(s.prompt_len + s.max_tokens, block_size) for s in specs)
    num_blocks = need + draw(st.integers(0, 6))
    budget = draw(st.integers(1, 48))
    max_num_seqs = draw(st.integers(1, 8))
    return policy, block_size, num_blocks, budget, max_num_seqs, specs


EOS = 2


def run_workload(policy, block_size, num_blocks, budget, max_num_seqs, specs):
    sched = make_scheduler(policy=policy, block_size=block_size, num_blocks=num_blocks,
                           budget=budget, max_num_seqs=max_num_seqs,
                           max_model_len=MAX_MODEL_LEN)
    cfg = sched.config
    reqs = {}
    for i, s in enumerate(specs):
        reqs[f"r{i}"] = make_request(f"r{i}", s.prompt_len, s.max_tokens, eos=(EOS,))
    spec_of = {f"r{i}": s for i, s in enumerate(specs)}
    aborted: set[str] = set()

    def token(req):
        s = spec_of[req.request_id]
        if s.eos_at is not None and req.num_output_tokens == s.eos_at:
            return EOS
        return fake_token(req)

    step = 0
    while step <= max(s.arrival for s in specs) or sched.has_unfinished():
        for rid, s in spec_of.items():
            if s.arrival == step:
                sched.add_request(reqs[rid])
        running_order_before = [r.request_id for r in sched.running]
        running_before = set(running_order_before)
        computed_before = {rid: r.num_computed_tokens for rid, r in reqs.items()}

        out = sched.schedule(float(step))

        # ---- the step's shape
        n = out.num_batched_tokens
        if policy == "chunked":
            assert n <= budget
        assert n <= cfg.token_budget
        ids = [sr.request_id for sr in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert len(ids) <= max_num_seqs and len(sched.running) <= max_num_seqs
        assert not set(ids) & set(out.preempted_request_ids)
        decodes = [sr.is_decode for sr in out.scheduled]
        assert decodes == sorted(decodes, reverse=True), "decodes must come first"
        for sr in out.scheduled:
            r = reqs[sr.request_id]
            assert r.status is RequestStatus.RUNNING
            assert sr.block_ids == sched.kv.get_block_table(r.request_id)
            assert sr.token_ids == (r.prompt_token_ids + r.output_token_ids)[sr.start_pos:sr.end_pos]
            assert sr.num_new_tokens >= 1
            assert sr.start_pos == r.num_computed_tokens
            assert sr.end_pos <= r.num_tokens
            assert len(sched.kv.get_block_table(r.request_id)) >= cdiv(sr.end_pos, block_size)
            if policy != "chunked":
                assert sr.start_pos == 0 or sr.is_decode, "no chunking outside chunked"
                assert sr.samples
        k = len(out.preempted_request_ids)
        if k:
            # the victims are the most recently admitted running requests, newest first, and
            # they now head the waiting queue (the last one preempted in front)
            assert out.preempted_request_ids == running_order_before[::-1][:k]
            assert [r.request_id for r in list(sched.waiting)[:k]] == \
                out.preempted_request_ids[::-1]
            for rid in out.preempted_request_ids:
                r = reqs[rid]
                assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
                assert not sched.kv.get_block_table(rid)
            # nothing new is admitted in a step that preempted
            assert set(ids) <= running_before
        if policy == "static" and running_before:
            assert set(ids) <= running_before, "static admitted while its batch runs"
        if not out.scheduled:
            assert not sched.running and not sched.waiting, \
                "stall: requests are unfinished but nothing was scheduled"

        # ---- random aborts (mid-step: after schedule, before the update)
        for rid, s in spec_of.items():
            if s.abort_at == step and s.abort_mid_step and not reqs[rid].is_finished \
                    and rid in sched.requests:
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)

        runner_out = ModelRunnerOutput(
            req_ids=[sr.request_id for sr in out.scheduled],
            sampled_token_ids=[[token(reqs[sr.request_id])] if sr.samples else []
                               for sr in out.scheduled])
        finished = [reqs[o.request_id] for o in
                    sched.update_from_output(out, runner_out, float(step)) if o.finished]
        for r in finished:
            assert r.is_finished and r.request_id not in sched.requests
            assert not sched.kv.get_block_table(r.request_id)
        for sr in out.scheduled:
            r = reqs[sr.request_id]
            if r.request_id not in aborted:
                assert r.num_computed_tokens == computed_before[r.request_id] + sr.num_new_tokens

        for rid, s in spec_of.items():
            if s.abort_at == step and not s.abort_mid_step and rid in sched.requests:
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)

        check_kv_invariants(sched)
        step += 1
        assert step < 2000, "workload did not finish"

    # ---- the end state
    assert sched.kv.num_free_blocks == num_blocks
    assert not sched.running and not sched.waiting and not sched.requests
    assert all(c == 0 for c in sched.kv.pool._ref_cnt)
    for rid, r in reqs.items():
        s = spec_of[rid]
        assert r.is_finished
        if rid in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            assert r.num_output_tokens <= s.max_tokens
            assert r.output_token_ids == [token_at(rid, s, i) for i in range(r.num_output_tokens)]
            continue
        if s.eos_at is not None and s.eos_at < s.max_tokens:
            assert r.status is RequestStatus.FINISHED_STOPPED
            assert r.output_token_ids == [token_at(rid, s, i) for i in range(s.eos_at + 1)]
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected_outputs(rid, s.max_tokens)
    return sched


def token_at(rid, s: Spec, i: int) -> int:
    if s.eos_at is not None and i == s.eos_at:
        return EOS
    return expected_outputs(rid, i + 1)[-1]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_complete_with_exact_outputs(wl):
    run_workload(*wl)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_eos=True))
def test_random_workloads_with_eos(wl):
    run_workload(*wl)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["chunked", "naive", "static"]), st.integers(2, 6),
       st.sampled_from([1, 2, 4]), st.integers(4, 20), st.integers(0, 10))
def test_tight_pool_forces_preemption_and_still_completes(policy, n_req, block_size, p, extra):
    """n identical requests (prompt p, max_tokens m >= p + block_size) arrive at once into a pool
    that holds exactly one of them: the first two are admitted together (2 * ceil(p / bs) blocks
    fit), and both growing to p + m - 1 tokens cannot fit, so preemption must happen; every
    request still completes with exactly m outputs."""
    m = p + block_size + extra
    specs = [Spec(p, m, 0, None, False) for _ in range(n_req)]
    need = cdiv(p + m, block_size)
    assert 2 * cdiv(p, block_size) <= need < 2 * cdiv(p + m - 1, block_size)
    sched = run_workload(policy, block_size, need, 64, 8, specs)
    assert sched.num_preemptions >= 1
