"""Speculative decoding is lossless with each method (ngram, suffix, layer_skip, draft_model):
on the embedded SmolLM2-135M, in float32 under ``--batch-invariant`` (so that a position's
logits do not depend on the step's shape: a verify step computes 1 + k positions of a request in
one pass), every request gives the same token ids, logprobs, text, finish and completion tokens
with drafts as without, for k = 4 and 1, beside batch-mates, chunked under a small token budget
(drafts trimmed to it), through preemption in a tight KV cache, after a prefix-cache hit, with a
stop string and EOS inside accepted runs. Each case also checks that drafts were verified and
that some were accepted and some rejected (the path under test ran).

One engine for the module: drafts on and off by swapping the core's drafter and the runner's
model drafter (the only difference between the runs); the results without drafts are computed
once."""
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
def drafts(llm, k: int | None, spec: SpeculativeConfig | None = None, model_drafter=None):
    """Drafts of k tokens (None: off) inside the block: n-gram, or ``spec``'s method with
    ``model_drafter`` in the runner (the model methods)."""
    core = llm.engine.core
    runner = core.model_executor.driver_worker.model_runner
    before = core.drafter, runner.drafter
    spec = dataclasses.replace(spec or config(k), num_speculative_tokens=k or 1)
    core.drafter = Drafter(spec) if k else None
    runner.drafter = model_drafter if k else None
    try:
        yield
    finally:
        core.drafter, runner.drafter = before


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


def on_and_off(llm, items, k: int = 4, tokens: int | None = None, spec=None,
               model_drafter=None, off=None):
    """The items' results without drafts (or ``off``, computed before) and with k drafts; the
    spec-decode counts of the run with."""
    with contextlib.ExitStack() as stack:
        if tokens:
            stack.enter_context(scheduler_budget(llm, tokens))
        if off is None:
            with drafts(llm, None):
                off = run(llm, items)
        stats = llm.engine.summary.spec_decoding
        before = dataclasses.replace(stats, num_accepted_tokens_per_pos=[])
        with drafts(llm, k, spec, model_drafter):
            on = run(llm, items)
    return off, on, (stats.num_drafts - before.num_drafts,
                     stats.num_draft_tokens - before.num_draft_tokens,
                     stats.num_accepted_tokens - before.num_accepted_tokens)


def assert_lossless(off, on, counts):
    assert on == off
    drafts_, draft_tokens, accepted = counts
    assert drafts_ > 0 and 0 < accepted < draft_tokens  # accepted and rejected drafts


# ------------------------------------------------------------------ the scenario
# One scenario for every method, its results without drafts computed once: twelve requests under a
# token budget of 24 (chunked prefill, drafts trimmed to the budget) in the cache of 320 tokens
# (preemptions), COPY a second time after its blocks were cached (a prefix-cache hit), a stop
# string an accepted run crosses, a chat answer that ends with EOS, logprobs throughout.
def scenario(llm):
    chat = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say the word yes, and nothing else."}],
        add_generation_prompt=True)
    return [(COPY, GREEDY), (NUMBERS, GREEDY), (COPY, dataclasses.replace(
        GREEDY, stop=["silver"], max_tokens=60)), (chat, dataclasses.replace(
            GREEDY, max_tokens=60))] + [
        (f"{ROME} {i}" * (1 + i % 3), dataclasses.replace(GREEDY, max_tokens=20 + i))
        for i in range(8)]


@pytest.fixture(scope="module")
def scenario_off(llm):
    items = scenario(llm)
    run(llm, [(COPY, dataclasses.replace(GREEDY, max_tokens=1))])  # caches COPY's blocks
    with scheduler_budget(llm, 24), drafts(llm, None):
        off = run(llm, items)
    assert "quick brown fox" in off[0][2] and len(off[1][0]) == 40
    assert off[2][3][0] == "stop" and "silver" not in off[2][2]  # the stop string
    assert off[3][3][0] == "stop" and off[3][3][2] < 60           # EOS
    return items, off


@pytest.fixture(scope="module")
def draft_checkpoint(llm, tmp_path_factory):
    """A draft model for ``draft_model``: the embedded model's first 24 of 30 layers, written
    as a Hugging Face folder in bfloat16 (``sloserve.tools.draft_checkpoint``): the same
    vocabulary, its own weights and KV cache, and drafts that are sometimes right."""
    from sloserve.tools.draft_checkpoint import write_draft_checkpoint
    worker = llm.engine.core.model_executor.driver_worker
    return write_draft_checkpoint(24, str(tmp_path_factory.mktemp("draft")), "bfloat16",
                                  loaded=(worker.model, llm.tokenizer))


def model_drafter(llm, spec: SpeculativeConfig):
    """The worker's drafter for a model method, as the worker builds it."""
    from sloserve.model.draft import ModelDrafter
    from sloserve.model.model_loader import get_model
    from sloserve.model.runner import ModelRunner
    worker = llm.engine.core.model_executor.driver_worker
    runner = worker.model_runner
    if spec.method == "layer_skip":
        model, caches = worker.model, runner.kv_caches
    else:
        model = get_model(dataclasses.replace(worker.config, model=spec.model,  # int8: fast
                                              batch_invariant=False, quantization="int8"),
                          worker.dtype)[0]
        caches = ModelRunner.allocate_kv(model.config, runner.num_blocks, runner.block_size,
                                         runner.kv_cache_dtype, runner.attn_backend)
    return ModelDrafter(model, caches, spec.num_draft_layers if spec.method == "layer_skip"
                        else None, runner.attn_backend, runner.block_size, runner.sampler,
                        spec.draft_sample_method == "probabilistic",
                        catch_up=spec.method == "draft_model")


#: (probabilistic drafts: greedy requests draft the argmax, as vLLM; their distribution is
#: tests/spec_decode/test_rejection_sampling.py's)
METHODS = {
    "ngram": {"method": "ngram", "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
    "layer_skip": {"method": "layer_skip", "num_draft_layers": 24},
    "draft_model": {"method": "draft_model"},
}


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_is_lossless(llm, scenario_off, request, method):
    """Token ids, logprobs, text, finish and completion tokens the same with drafts of k = 4
    (the scenario) and k = 1 (COPY alone) as without; drafts proposed, some accepted, some
    rejected."""
    items, off = scenario_off
    raw = dict(METHODS[method], num_speculative_tokens=4, min_acceptance_rate=0)
    if method == "draft_model":
        raw["model"] = request.getfixturevalue("draft_checkpoint")
    spec = SpeculativeConfig.parse(raw)
    md = model_drafter(llm, spec) if spec.uses_model else None
    run(llm, [(COPY, dataclasses.replace(GREEDY, max_tokens=1))])  # COPY's blocks cached again
    hits = llm.engine.core.kv.prefix_cache_hits
    preempted = llm.engine.summary.num_preemptions
    _, on, counts = on_and_off(llm, items, 4, tokens=24, spec=spec, model_drafter=md, off=off)
    assert llm.engine.core.kv.prefix_cache_hits > hits
    assert llm.engine.summary.num_preemptions > preempted
    assert_lossless(off, on, counts)
    one = off[:1]
    _, on1, counts1 = on_and_off(llm, items[:1], 1, spec=spec, model_drafter=md, off=one)
    assert on1 == one and counts1[0] > 0


def test_a_json_schema_request_drafts_within_its_grammar(llm):
    """A JSON-schema request that copies JSON from its prompt takes n-gram drafts: each draft
    position gets its own mask, and the output is the one without drafts."""
    import json
    from sloserve.sampling_params import StructuredOutputsParams
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "city": {"type": "string"}},
              "required": ["name", "city"]}
    record = '{"name": "The quick brown fox", "city": "Rome"}'
    prompt = f"Write the JSON again with the city changed to Paris.\nJSON: {record}\nNew JSON:"
    sp = dataclasses.replace(GREEDY, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=json.dumps(schema)))
    off, on, counts = on_and_off(llm, [(prompt, sp)])
    assert_lossless(off, on, counts)
    assert json.loads(on[0][2])["name"] == "The quick brown fox"


@pytest.mark.parametrize("method", ["ngram", "suffix", "layer_skip_probabilistic"])
def test_a_seeded_request_with_drafts(llm, method):
    """A sampled request with a seed draws the token at each index of its sequence with its
    own uniform of that index (``sloserve.model.sampler.uniform``): with deterministic drafts
    (n-gram, suffix: their drafts come from other requests' outputs too) it samples the tokens
    it samples without drafts, whatever was drafted, accepted or batched beside it; with
    probabilistic layer-skip drafts (each drawn from q, verified by rejection sampling on the
    served model) it repeats itself run to run."""
    raw = {"ngram": dict(METHODS["ngram"]), "suffix": dict(METHODS["suffix"]),
           "layer_skip_probabilistic": dict(METHODS["layer_skip"],
                                            draft_sample_method="probabilistic")}[method]
    spec = SpeculativeConfig.parse(dict(raw, num_speculative_tokens=4, min_acceptance_rate=0))
    md = model_drafter(llm, spec) if spec.uses_model else None
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24, logprobs=1)
    mates = [(f"{ROME} {i}", GREEDY) for i in range(3)]
    stats = llm.engine.summary.spec_decoding
    drafted = stats.num_draft_tokens
    with drafts(llm, 4, spec, md):
        first = run(llm, [(COPY, sp)])
        if method == "layer_skip_probabilistic":
            assert run(llm, [(COPY, sp)]) == first
        else:
            second = run(llm, [(COPY, sp)] + mates)[:1]
    assert stats.num_draft_tokens > drafted and len(first[0][0]) > 0
    if method != "layer_skip_probabilistic":
        with drafts(llm, None):
            assert run(llm, [(COPY, sp)]) == first == second

