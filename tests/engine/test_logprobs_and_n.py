"""Logprobs, prompt logprobs and ``n`` siblings through the in-process engine, on a tiny random
Llama checkpoint in float32 with transformers' own forward as the reference.

Tolerance: |logprob - transformers' log_softmax| < 1e-4 (float32, the same weights; the engine
computes through the paged cache in chunks). A random model's distribution is nearly flat, so
ranks and top-k ids are checked up to values within that tolerance (near-ties may swap).
"""
from __future__ import annotations

import pytest
import torch

from sloserve.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.sampling_params import SamplingParams

TOL = 1e-4
PROMPT = list(range(5, 45))  # 40 prompt tokens: 2 full blocks of 16 + 8


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def ref_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of transformers' logits at every position of ids."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def make_engine(tiny_llama_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", block_size=16,
                                  enforce_eager=True, **kw))


def run(engine: LLMEngine, reqs) -> dict:
    """Run requests made by engine.make_request to the end; request id -> its outputs."""
    outs: dict = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def prompt_lps(outs):
    got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(got) == 1, "prompt logprobs come once, with the first output"
    return got[0]


def assert_prompt_logprobs_match(lp, ref: torch.Tensor, prompt: list[int], k: int) -> None:
    """`lp` holds every prompt position once, each within TOL of transformers' `ref` (ranks and
    the top-k ids up to near-ties within TOL)."""
    assert len(lp) == len(prompt) - 1
    for i in range(len(prompt) - 1):  # position i predicts prompt token i + 1
        tok = prompt[i + 1]
        assert lp.token_ids[i][0] == tok
        assert abs(lp.logprobs[i][0] - float(ref[i, tok])) < TOL
        v = float(ref[i, tok])
        assert int((ref[i] > v + TOL).sum()) + 1 <= lp.ranks[i] <= int((ref[i] > v - TOL).sum()) + 1
        top = torch.topk(ref[i], k)
        assert len(lp.token_ids[i]) == k + 1
        assert max(abs(a - b) for a, b in zip(lp.logprobs[i][1:], top.values.tolist())) < TOL
        for t, val in zip(lp.token_ids[i][1:], lp.logprobs[i][1:]):
            assert abs(float(ref[i, t]) - val) < TOL  # each listed id has the value given


@pytest.mark.parametrize("budget", [8, 512])  # 5 chunks of 8 tokens, or the whole prompt
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_model, budget):
    eng = make_engine(tiny_llama_dir, max_num_batched_tokens=budget)
    req = eng.make_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    lp = prompt_lps(run(eng, [req])[req.request_id])
    assert_prompt_logprobs_match(lp, ref_logprobs(hf_model, PROMPT), PROMPT, 3)


def test_sampled_logprobs_match_transformers_and_greedy_is_rank_1(tiny_llama_dir, hf_model):
    eng = make_engine(tiny_llama_dir)
    req = eng.make_request(PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                  ignore_eos=True))
    outs = run(eng, [req])[req.request_id]
    toks = [t for o in outs for t in o.new_token_ids]
    lps = [o.new_logprobs for o in outs if o.new_token_ids]
    assert sum(len(x) for x in lps) == len(toks) == 6
    ref = ref_logprobs(hf_model, PROMPT + toks)
    j = 0
    for x in lps:
        for i in range(len(x)):
            pos = len(PROMPT) - 1 + j
            assert x.token_ids[i][0] == toks[j] == x.token_ids[i][1]  # greedy: the top token
            assert x.ranks[i] == 1
            assert abs(x.logprobs[i][0] - float(ref[pos, toks[j]])) < TOL
            assert len(x.token_ids[i]) == 3
            j += 1


def test_prompt_logprobs_take_no_prefix_cache_blocks(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=1)
    first = eng.make_request(PROMPT, sp, "warm")
    run(eng, [first])  # its 2 full blocks are now cached
    plain = eng.make_request(PROMPT, sp, "plain")
    with_lp = eng.make_request(PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                      prompt_logprobs=0), "lp")
    outs = run(eng, [plain])
    assert outs["plain"][-1].num_cached_tokens == 32
    outs = run(eng, [with_lp])
    assert outs["lp"][-1].num_cached_tokens == 0
    assert len(prompt_lps(outs["lp"])) == len(PROMPT) - 1


def test_prompt_logprobs_survive_preemption_once_each(tiny_llama_dir, hf_model):
    """Two long requests in a cache too small for both: one is preempted and recomputed; the
    prompt logprobs of each still come once per position, within TOL of transformers' (they
    are computed in other batches than an undisturbed run's, so not compared with it exactly:
    a top id or rank may differ on a near-tie)."""
    sp = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1, ignore_eos=True)
    eng = make_engine(tiny_llama_dir, num_kv_blocks=8, max_model_len=128,
                      max_num_batched_tokens=16)
    outs = run(eng, [eng.make_request(PROMPT, sp, "a"), eng.make_request(PROMPT[::-1], sp, "b")])
    assert eng.scheduler.num_preemptions > 0
    for rid, prompt in (("a", PROMPT), ("b", PROMPT[::-1])):
        assert_prompt_logprobs_match(prompt_lps(outs[rid]), ref_logprobs(hf_model, prompt),
                                     prompt, 1)


def test_n_siblings_prefill_the_prompt_once_and_share_its_blocks(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    base = eng.make_request(PROMPT, sp, "c-0", parent_request_id="c")
    import msgspec
    reqs = [base] + [msgspec.structs.replace(base, request_id=f"c-{i}") for i in (1, 2)]
    outs = run(eng, reqs)
    texts = [[t for o in outs[r.request_id] for t in o.new_token_ids] for r in reqs]
    assert texts[0] == texts[1] == texts[2]  # greedy: same tokens, the siblings from cache
    assert [outs[r.request_id][-1].num_cached_tokens for r in reqs] == [0, 32, 32]
    assert eng.kv.prefix_cache_hits == 64
    assert eng.kv.num_free_blocks == eng.num_kv_blocks  # nothing leaked (cached blocks are free)


def test_n_siblings_without_prefix_caching_run_side_by_side(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    base = eng.make_request(PROMPT, sp, "c-0", parent_request_id="c")
    import msgspec
    reqs = [base, msgspec.structs.replace(base, request_id="c-1")]
    for r in reqs:
        eng.add(r)
    eng.step()
    assert len(eng.scheduler.running) == 2  # nothing to share: no waiting


def test_processed_logprobs_follow_top_k(tiny_llama_dir):
    eng = make_engine(tiny_llama_dir, logprobs_mode="processed_logprobs")
    req = eng.make_request(PROMPT, SamplingParams(temperature=0.7, top_k=3, max_tokens=3,
                                                  logprobs=5, seed=1, ignore_eos=True))
    outs = run(eng, [req])[req.request_id]
    for o in outs:
        for vals in (o.new_logprobs.logprobs if o.new_logprobs else []):
            top = vals[1:]
            assert all(v == float("-inf") for v in top[3:])          # outside top-k
            assert abs(sum(torch.tensor(top[:3]).exp().tolist()) - 1) < 1e-5  # renormalised
