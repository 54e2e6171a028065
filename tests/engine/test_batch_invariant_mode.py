"""``--batch-invariant`` end to end on the embedded SmolLM2-135M (its GGUF weights on the
quantized kernels), in bfloat16 and float32: issue 33's reproducers (a greedy "The history of
Rome", a sampled "Hi" with seed 7) give the same token ids and logprobs, bit for bit, alone,
as the choices of ``n = 4``, beside 15 random batch-mates (in a KV cache small enough that
some of them are preempted and recomputed), chunked under a small token budget, after a
prefix-cache hit and on another thread count. Exact equality is what the mode guarantees
(``sloserve.model.invariant``); without the flag none of it is promised.

One engine per dtype for the whole module; a few tokens per request keep it short.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from sloserve.sampling_params import SamplingParams, child_seed  # noqa: E402
from tests.engine.conftest import require_embedded_model, scheduler_budget  # noqa: E402

ROME = "The history of Rome"
HI = "Hi"
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=8, seed=7, logprobs=3, ignore_eos=True)


#: KV blocks of 16 tokens: 384 tokens, less than 17 requests' prompts and outputs
NUM_KV_BLOCKS = 24


def _mates(n: int = 15) -> list[tuple[list[int], SamplingParams]]:
    """n random token-id prompts (1-48 tokens), half greedy, half sampled with seeds."""
    g = torch.Generator().manual_seed(33)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 49, (1,), generator=g))
        ids = torch.randint(100, 40000, (length,), generator=g).tolist()
        sp = (SamplingParams(temperature=0.0, max_tokens=3 + i % 4, ignore_eos=True) if i % 2
              else SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i,
                                  max_tokens=3 + i % 4, ignore_eos=True))
        out.append((ids, sp))
    return out


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def llm(request):
    require_embedded_model(kernels=True)
    import sloserve
    llm = sloserve.LLM(model=None, dtype=request.param, batch_invariant=True,
                       num_kv_blocks=NUM_KV_BLOCKS, max_num_batched_tokens=512)
    assert "--batch-invariant" in llm.engine.info.dtype_reason
    return llm


def run(llm, items) -> list[tuple[list[int], list]]:
    """Run (prompt, params) items together to the end; per item (token ids, logprobs as
    (ids, values, rank) per position)."""
    eng = llm.engine
    reqs = [eng.make_request(p, sp) for p, sp in items]
    got = {r.request_id: ([], []) for r in reqs}
    for r in reqs:
        eng.add(r)
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks, lps = got[o.request_id]
            toks += o.new_token_ids
            if o.new_logprobs is not None:
                lp = o.new_logprobs
                lps += list(zip(lp.token_ids, lp.logprobs, lp.ranks))
    return [got[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def alone(llm):
    """Each reproducer alone in the engine."""
    return {ROME: run(llm, [(ROME, GREEDY)])[0], HI: run(llm, [(HI, SEEDED)])[0]}


def test_reproducers_are_not_trivial(alone):
    toks, lps = alone[ROME]
    assert len(toks) == 16 and len(set(toks)) >= 4 and len(lps) == 16
    toks, lps = alone[HI]
    assert len(toks) == 8 and len(lps) == 8
    assert any(rank > 1 for _, _, rank in lps)  # it sampled, not just the argmax


def test_n4_choices(llm, alone):
    """n = 4 as the server makes it: four copies of the prompt, choice i seeded seed + i.
    Every greedy choice is the greedy request alone; the seeded choice 0 is the seeded request
    alone (and the other choices differ from it: their own streams)."""
    outs = run(llm, [(ROME, GREEDY)] * 4)
    assert outs == [alone[ROME]] * 4
    outs = run(llm, [(HI, dataclasses.replace(SEEDED, seed=child_seed(7, i))) for i in range(4)])
    assert outs[0] == alone[HI]
    assert any(o[0] != alone[HI][0] for o in outs[1:])


def test_beside_15_random_batch_mates(llm, alone):
    """Beside 15 random requests; they do not fit the KV cache together, so some are
    preempted and computed again (their generated tokens on the decode kernel again)."""
    mates = _mates()
    sched = llm.engine.scheduler
    before = sched.num_preemptions
    outs = run(llm, [(ROME, GREEDY), *mates[:8], (HI, SEEDED), *mates[8:]])
    assert sched.num_preemptions > before
    assert outs[0] == alone[ROME]
    assert outs[9] == alone[HI]
    # a batch-mate is invariant too: the longest one alone
    i = max(range(len(mates)), key=lambda j: len(mates[j][0]))
    assert run(llm, [mates[i]])[0] == outs[1 + i + (i >= 8)]


def test_chunked_prefill(llm, alone):
    """A token budget of 3 per step cuts both prompts (and their batch-mates') into chunks,
    some of one token, while the other requests decode."""
    mates = _mates(3)
    with scheduler_budget(llm, 3):
        outs = run(llm, [mates[0], (ROME, GREEDY), mates[1], (HI, SEEDED), *mates[2:]])
    assert outs[1] == alone[ROME]
    assert outs[3] == alone[HI]


@pytest.mark.parametrize("length", [37, 33])
def test_prefix_cache_hit(llm, length):
    """A prompt computed once, then again from the prefix cache (its 2 full blocks of 16): 37
    tokens (a 5-token chunk after the cached ones) or 33 (its last token computed on its own,
    as a decode step is)."""
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(100, 40000, (length,), generator=g).tolist()
    first = run(llm, [(prompt, GREEDY)])[0]
    eng = llm.engine
    req = eng.make_request(prompt, GREEDY)
    eng.add(req)
    cached, toks = 0, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            cached = max(cached, o.num_cached_tokens)
            toks += o.new_token_ids
    assert cached == 32
    assert toks == first[0]


def test_thread_count(llm, alone):
    before = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert run(llm, [(ROME, GREEDY), (HI, SEEDED)]) == [alone[ROME], alone[HI]]
    finally:
        torch.set_num_threads(before)
