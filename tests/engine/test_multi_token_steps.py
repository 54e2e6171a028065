"""Steps where a request contributes several query tokens after cached context: draft tokens
verified in one step (speculative decoding's seam). Greedy output is identical whether drafts are
right, wrong or absent; rejected drafts are rolled back (KV slots, blocks); the scheduler output
and the runner output are plain data that survive encoding."""
from __future__ import annotations

import pytest

import sloserve
from sloserve.engine.kv_cache_manager import cdiv
from sloserve.engine.messages import (EngineCoreAbort, EngineCoreOutput, EngineCoreOutputs,
                                      EngineCoreRequest, SchedulerStats, StepStats,
                                      decode_from_core, decode_to_core, encoder)
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import (ModelRunnerOutput, decode_runner_output, decode_scheduler_output,
                              encode_runner_output, encode_scheduler_output)

from .conftest import check_kv_invariants, make_request, make_scheduler


# ----------------------------------------------------------------------------- plain data
def test_scheduler_output_round_trips_through_the_encoder():
    sched = make_scheduler(budget=8, block_size=4)
    a, b = make_request("a", 11, max_tokens=5, temperature=0.7, seed=3, stop=["x"]), \
        make_request("b", 3, max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule(0.0)
    data = encode_scheduler_output(out)
    assert isinstance(data, bytes)
    back = decode_scheduler_output(data)
    assert back == out
    assert back.scheduled[0].sampling_params == a.sampling_params
    assert back.composition() == out.composition() == ((), ((8, 0),))
    ro = ModelRunnerOutput(["a"], [[]], 0.1, 0.2, 0.3)
    assert decode_runner_output(encode_runner_output(ro)) == ro


def test_core_messages_round_trip():
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4),
                            12.5, eos_token_ids=[2], parent_request_id="p")
    assert decode_to_core(encoder.encode(req)) == req
    assert decode_to_core(encoder.encode(EngineCoreAbort(["r1"]))) == EngineCoreAbort(["r1"])
    outs = EngineCoreOutputs(
        [EngineCoreOutput("r1", [5, 6], finish_reason="stop", stop_reason=6,
                          num_output_tokens=2, num_accepted_draft_tokens=1)],
        SchedulerStats(1, 0, 10, 12, 2 / 12, 0, 3),
        StepStats(1.0, 0.01, 0.008, 4, 3, 1, 2, 0, 0.1), 1.01)
    assert decode_from_core(encoder.encode(outs)) == outs


# ----------------------------------------------------------------------------- the scheduler
def test_rejected_drafts_are_rolled_back():
    """Block size 4: a 6-token prompt decodes with 5 drafts (positions 6..11, a third block);
    the runner accepts 1: 2 tokens appended, computed tokens = 7, the third block freed."""
    sched = make_scheduler(budget=16, block_size=4, num_blocks=8)
    r = make_request("a", 6, max_tokens=20)
    sched.add_request(r)
    out = sched.schedule(0.0)
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[100]]))
    r.spec_token_ids = [101, 102, 103, 104, 105]
    out = sched.schedule(1.0)
    sr = out.scheduled[0]
    assert (sr.num_computed_tokens, sr.num_new_tokens, sr.is_decode) == (6, 6, True)
    assert sr.token_ids == [100, 101, 102, 103, 104, 105] and len(sr.block_ids) == 3
    assert out.num_decode_tokens == 6 and out.composition() == ((12,), ())
    (o,) = sched.update_from_output(out, ModelRunnerOutput(["a"], [[101, 999]]), 1.0)
    assert o.new_token_ids == [101, 999] and o.num_accepted_draft_tokens == 1
    assert r.output_token_ids == [100, 101, 999]
    assert r.num_computed_tokens == 8 and r.num_tokens == 9 and r.spec_token_ids == []
    assert len(sched.kv.get_block_table("a")) == cdiv(8, 4) == 2
    check_kv_invariants(sched)
    with pytest.raises(ValueError, match="do not fit 2 draft tokens"):
        r.spec_token_ids = [7, 8]
        bad = sched.schedule(2.0)
        sched.update_from_output(bad, ModelRunnerOutput(["a"], [[9, 8]]))


def test_drafts_fit_the_budget_and_max_model_len():
    sched = make_scheduler(budget=4, block_size=4, max_model_len=10)
    r = make_request("a", 3, max_tokens=4)
    sched.add_request(r)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(["a"], [[50]]))
    r.spec_token_ids = [1, 2, 3, 4, 5, 6]
    sr = sched.schedule().scheduled[0]
    assert sr.spec_token_ids == [1, 2, 3]  # budget 4 = the last token + 3 drafts
    sched2 = make_scheduler(budget=16, block_size=4, max_model_len=9)
    r2 = make_request("b", 6, max_tokens=3)
    sched2.add_request(r2)
    sched2.update_from_output(sched2.schedule(), ModelRunnerOutput(["b"], [[50]]))
    r2.spec_token_ids = [1, 2, 3, 4]
    assert sched2.schedule().scheduled[0].spec_token_ids == [1, 2]  # positions up to 8


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    sched = make_scheduler(budget=16, block_size=4)
    r = make_request("a", 5, max_tokens=20, eos=(3,))
    sched.add_request(r)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput(["a"], [[50]]))
    r.spec_token_ids = [51, 3, 52]
    out = sched.schedule()
    (o,) = sched.update_from_output(out, ModelRunnerOutput(["a"], [[51, 3, 52, 53]]))
    assert o.new_token_ids == [51, 3] and o.finish_reason == "stop" and o.stop_reason == 3
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == sched.kv.pool.num_blocks


# ----------------------------------------------------------------------------- with the model
@pytest.fixture(scope="module")
def llm(tiny_llama_dir, single_thread):
    return sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128, block_size=4,
                        max_num_batched_tokens=64)


PROMPTS = [[11 + 3 * j for j in range(n)] for n in (5, 9, 14)]


def _run(llm, drafts_for, n_out=12):
    """Greedy generation of PROMPTS, with `drafts_for(rid, output so far)` proposing draft
    tokens before every step. Returns (outputs, steps)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in PROMPTS]
    final, steps = {}, 0
    while eng.has_unfinished_requests():
        for r in eng.scheduler.running:
            if r.num_output_tokens and r.num_tokens_to_compute == 1:
                r.spec_token_ids = drafts_for(r.request_id, list(r.output_token_ids))
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
        steps += 1
        check_kv_invariants(eng.scheduler)
    assert eng.kv.num_free_blocks == eng.num_kv_blocks
    return [final[i] for i in ids], steps


def test_verify_steps_give_the_greedy_output_with_right_wrong_or_no_drafts(llm):
    ref, steps_ref = _run(llm, lambda rid, out: [])
    # the reference continuation of each request, by its position among the added ones
    order: dict[str, int] = {}

    def oracle(rid, out, k=3):
        i = order.setdefault(rid, len(order))
        return ref[i][len(out):len(out) + k]

    right, steps_right = _run(llm, oracle)
    assert right == ref
    assert steps_right < steps_ref  # accepted drafts saved steps
    order.clear()
    wrong, steps_wrong = _run(llm, lambda rid, out: [(t + 1) % 49152 for t in oracle(rid, out)])
    assert wrong == ref
    assert steps_wrong == steps_ref  # every draft rejected: one token per step, as without
