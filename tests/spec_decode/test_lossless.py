"""Speculative decoding (n-gram drafts) is lossless: on the embedded SmolLM2-135M, in float32
under ``--batch-invariant`` (so that a position's logits do not depend on the step's shape: a
verify step computes 1 + k positions of a request in one pass), every request gives the same
token ids, logprobs, text and finish with drafts as without, for k = 1 and 4, beside batch-mates,
chunked under a small token budget, through preemption in a tight KV cache, after a prefix-cache
hit, with stop strings and EOS inside accepted runs. Each case also checks that drafts were
verified and that some were rejected (the path under test ran).

One engine for the module: drafts on and off by swapping the core's drafter (the only
difference between the two runs)."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from sloserve.sampling_params import SamplingParams  # noqa: E402
from sloserve.config import SpeculativeConfig  # noqa: E402
from sloserve.spec_decode.drafter import Drafter  # noqa: E402
from tests.engine.conftest import require_embedded_model, scheduler_budget  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
        "Every cloud has a silver lining. ")
COPY = f"Repeat the text three times.\nText: {TEXT}\nRepeated: {TEXT}"
NUMBERS = "Count from 1 to 40: 1, 2, 3, 4,"
ROME = "The history of Rome"
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
NUM_KV_BLOCKS = 20  # 320 tokens: the batch of twelve below does not fit at once


def config(k: int) -> SpeculativeConfig:
    return SpeculativeConfig("ngram", k, 1, 4)


@pytest.fixture(scope="module")
def llm():
    require_embedded_model(kernels=True)
    import sloserve
    return sloserve.LLM(model=None, dtype="float32", batch_invariant=True,
                        num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=512,
                        speculative_config=config(4).to_dict())


@contextlib.contextmanager
def drafts(llm, k: int | None):
    """Drafts of k tokens (None: off) inside the block."""
    core = llm.engine.core
    before = core.drafter
    core.drafter = Drafter(config(k)) if k else None
    try:
        yield
    finally:
        core.drafter = before


def run(llm, items):
    """(prompt, params) items together to the end: per item (ids, logprobs, text, finish)."""
    eng = llm.engine
    reqs = [eng.make_request(p, sp) for p, sp in items]
    got = {r.request_id: [[], [], "", None] for r in reqs}
    for r in reqs:
        eng.add(r)
    while eng.has_unfinished_requests():
        for o in eng.step():
            g = got[o.request_id]
            g[0] += o.new_token_ids
            if o.new_logprobs is not None:
                lp = o.new_logprobs
                g[1] += list(zip(lp.token_ids, lp.logprobs, lp.ranks))
            g[2] += o.new_text
            if o.finished:
                g[3] = (o.finish_reason, o.text, o.num_output_tokens)
    return [tuple(got[r.request_id][:2]) + (got[r.request_id][2], got[r.request_id][3])
            for r in reqs]


def on_and_off(llm, items, k: int = 4, tokens: int | None = None):
    """The items' results without drafts and with k; the spec-decode counts of the run with."""
    with contextlib.ExitStack() as stack:
        if tokens:
            stack.enter_context(scheduler_budget(llm, tokens))
        with drafts(llm, None):
            off = run(llm, items)
        stats = llm.engine.summary.spec_decoding
        before = dataclasses.replace(stats, num_accepted_tokens_per_pos=[])
        with drafts(llm, k):
            on = run(llm, items)
    return off, on, (stats.num_drafts - before.num_drafts,
                     stats.num_draft_tokens - before.num_draft_tokens,
                     stats.num_accepted_tokens - before.num_accepted_tokens)


def assert_lossless(off, on, counts):
    assert on == off
    drafts_, draft_tokens, accepted = counts
    assert drafts_ > 0 and 0 < accepted < draft_tokens  # accepted and rejected drafts


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_outputs_and_logprobs_are_the_same_with_drafts(llm, k):
    off, on, counts = on_and_off(llm, [(COPY, GREEDY), (NUMBERS, GREEDY), (ROME, GREEDY)], k)
    assert_lossless(off, on, counts)
    assert "quick brown fox" in on[0][2] and len(on[2][0]) == 40


def test_beside_batch_mates_in_a_tight_kv_cache(llm):
    """Twelve requests (sampled ones with seeds among them: a seeded request's tokens are its
    own stream's, drafts or not) in a cache of 320 tokens: some are preempted and recomputed."""
    items = [(COPY, GREEDY), (NUMBERS, GREEDY)] + [
        (f"{ROME} {i}" * (1 + i % 3), SamplingParams(temperature=0.0, max_tokens=24 + i))
        for i in range(10)]
    preempted = llm.engine.summary.num_preemptions
    off, on, counts = on_and_off(llm, items)
    assert llm.engine.summary.num_preemptions > preempted
    assert_lossless(off, on, counts)


def test_chunked_prefill_and_a_budget_that_trims_drafts(llm):
    off, on, counts = on_and_off(llm, [(COPY, GREEDY), (NUMBERS, GREEDY)], tokens=24)
    assert_lossless(off, on, counts)


def test_after_a_prefix_cache_hit(llm):
    run(llm, [(COPY, dataclasses.replace(GREEDY, max_tokens=1))])  # caches COPY's blocks
    hits = llm.engine.core.kv.prefix_cache_hits
    off, on, counts = on_and_off(llm, [(COPY, GREEDY)])
    assert llm.engine.core.kv.prefix_cache_hits > hits
    assert_lossless(off, on, counts)


def test_stop_strings_and_eos_inside_accepted_runs(llm):
    """A stop string that an accepted run crosses ends the text where it ends without drafts,
    with the same completion token count; so does an EOS (a chat answer that ends by itself)."""
    stop = dataclasses.replace(GREEDY, stop=["silver"], max_tokens=60)
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say the word yes, and nothing else."}],
        add_generation_prompt=True)
    off, on, counts = on_and_off(llm, [(COPY, stop), (chat, dataclasses.replace(
        GREEDY, max_tokens=60))])
    assert_lossless(off, on, counts)
    assert on[0][3][0] == "stop" and "silver" not in on[0][2]
    assert on[1][3][0] == "stop" and on[1][3][2] < 60  # EOS
