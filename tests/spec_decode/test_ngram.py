"""The n-gram proposer and ``--speculative-config``'s checks (no model)."""
from __future__ import annotations

import pytest

from sloserve.config import EngineConfig, SpeculativeConfig
from sloserve.spec_decode.drafter import Drafter
from sloserve.spec_decode.ngram import NgramProposer


def test_the_longest_suffix_match_latest_occurrence_gives_what_followed():
    p = NgramProposer(1, 3)
    # suffix [1, 2, 3] occurs at 0 (followed by 9, 9) and at 5 (followed by 7, 8): the latest
    assert p.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 1, 2, 3], 2) == [7, 8]
    # no 3-gram match: the 2-gram [5, 6] at 0 is followed by 4
    assert p.propose([5, 6, 4, 0, 5, 6], 3) == [4, 0, 5]
    # fewer than k tokens after the match: what there is
    assert p.propose([7, 1, 2, 7], 5) == [1, 2, 7]
    # a run of one token proposes more of it (an occurrence may overlap the suffix)
    assert p.propose([3, 3, 3, 3], 2) == [3]
    assert NgramProposer(2, 3).propose([3, 3, 3, 3], 2) == [3]
    assert p.propose([1, 2, 3, 4], 4) == []
    assert p.propose([5], 4) == [] and p.propose([], 4) == []
    assert NgramProposer(2, 2).propose([1, 2, 9, 2], 2) == []  # only 1-grams match


def test_drafts_go_to_decoding_requests_within_max_tokens_and_the_context():
    """Scheduler.draft_candidates: running and past the prompt, no grammar; the count is what
    max_tokens (less the last token) and max_model_len leave; the drafter takes at most k."""
    from tests.engine.conftest import drive_step, make_request, make_scheduler
    sched = make_scheduler(budget=64, max_model_len=40)
    reqs = {"a": make_request("a", 8, max_tokens=10), "b": make_request("b", 8, max_tokens=3),
            "c": make_request("c", 8, max_tokens=2), "g": make_request("g", 8, max_tokens=10),
            "ctx": make_request("ctx", 36, max_tokens=None), "p": make_request("p", 30)}
    for r in reqs.values():
        sched.add_request(r)
    reqs["g"].grammar = object()
    sched.config.max_num_batched_tokens = 90  # all but p's prompt in the first step
    drive_step(sched)
    assert reqs["p"].is_prefilling
    got = {r.request_id: most for r, most in sched.draft_candidates()}
    assert got == {"a": 8, "b": 1, "ctx": 3}  # c: its last token; g: a grammar; p: prefilling
    d = Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2}))
    assert d.propose("r", [4, 5, 6, 7, 8, 9, 4, 5], 2, 8) == [6, 7, 8]
    assert d.propose("r", [4, 5, 6, 7, 8, 9, 4, 5], 2, 1) == [6]
    assert d.propose("r", [4, 5, 6, 7, 8, 9, 4, 5], 2, 0) == []


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ([1], "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram, suffix, draft_model, layer_skip"),
    ({"method": "ngram", "prompt_lookup_max": 2}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}, "in [1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": 2}, "needs prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min (3) is over prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": True}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "k": 1},
     "unknown key(s) k"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "needs num_draft_layers"),
    ({"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 0}, ">= 1, got 0"),
    ({"method": "layer_skip", "num_speculative_tokens": 2, "num_draft_layers": 4,
      "draft_sample_method": "random"}, "draft_sample_method must be one of greedy"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "in [0.0, 1.0], got 2"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "in [1, 1024], got 0"),
    ({"method": "suffix", "min_acceptance_rate": -0.1}, "min_acceptance_rate"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "disable_by_batch_size": 4, "num_speculative_tokens_per_batch_size": [[1, 2, 1]]},
     "not both"),
    ({"method": "layer_skip", "num_draft_layers": 8}, "num_speculative_tokens must be an "
                                                      "integer in [1, 32], missing"),
    ({"num_speculative_tokens": 4}, "method must be one of ngram, suffix, draft_model, "
                                    "layer_skip, missing"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "model": "x",
      "num_draft_layers": 3}, "model, num_draft_layers do(es) not apply to method ngram"),
    ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max do(es) not apply"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft.gguf"},
     "the draft model does not exist: /nonexistent/draft.gguf"),
])
def test_a_bad_speculative_config_is_refused_with_its_reason(value, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineConfig(speculative_config=value).validate()
    assert message in str(e.value)


def test_the_json_text_and_the_dict_are_the_same_config():
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}'
    a, b = EngineConfig(speculative_config=text), EngineConfig(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 5})
    assert a.speculative == b.speculative == SpeculativeConfig("ngram", 4, 1, 5)
    assert EngineConfig().speculative is None


def test_k_per_batch_size():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 3,
                                 "num_speculative_tokens_per_batch_size": [[2, 8, 2], [9, 64, 0]]})
    assert [c.k_for(b) for b in (1, 2, 8, 9, 64, 65)] == [4, 2, 2, 0, 0, 4]
    d = Drafter(c)
    toks = [4, 5, 6, 7, 8, 9, 4, 5]
    assert [d.propose("r", toks, 2, 8, b) for b in (1, 5, 20)] == [[6, 7, 8, 9], [6, 7], []]
    assert SpeculativeConfig.parse(c.to_dict()) == c
    for bad in ([[2, 1, 1]], [[1, 4, 5]], [[0, 4, 1]], [[1, 4]], "1-4:2"):
        with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
            SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_max": 3,
                                     "num_speculative_tokens_per_batch_size": bad})


def test_without_a_table_k_drops_with_the_batch():
    """A step of decodes and drafts holds at most DEFAULT_STEP_TOKENS (8) tokens, fewer when
    the quantized kernels' limit is lower; a user's table replaces the rule."""
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 3})
    d = Drafter(c, quantized_step_max_tokens=16)
    assert [d.k_for(b) for b in (1, 2, 3, 4, 5, 16)] == [4, 3, 1, 1, 0, 0]
    assert [Drafter(c).k_for(b) for b in (1, 2, 5)] == [4, 3, 0]  # no quantized weights
    assert [Drafter(c, quantized_step_max_tokens=6).k_for(b) for b in (1, 2, 3, 4)] == \
        [4, 2, 1, 0]
    table = SpeculativeConfig.parse(dict(c.to_dict(), num_speculative_tokens_per_batch_size=[
        [1, 64, 4]]))
    assert Drafter(table, quantized_step_max_tokens=16).k_for(16) == 4


def test_the_methods_defaults_and_vllm_v0_switch_off():
    suffix = SpeculativeConfig.parse({"method": "suffix"})
    assert (suffix.num_speculative_tokens, suffix.suffix_decoding_max_tree_depth,
            suffix.suffix_decoding_max_cached_requests, suffix.suffix_decoding_max_spec_factor,
            suffix.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    ls = SpeculativeConfig.parse({"method": "layer_skip", "num_speculative_tokens": 3,
                                  "num_draft_layers": 8})
    assert ls.uses_model and ls.draft_sample_method == "greedy" and "first 8 layers" in \
        ls.describe()
    v0 = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 2, "disable_by_batch_size": 4})
    assert [v0.k_for(b) for b in (1, 3, 4, 100)] == [3, 3, 0, 0]
    for c in (suffix, ls, v0):
        assert SpeculativeConfig.parse(c.to_dict()) == c


def test_model_methods_propose_placeholders_for_the_worker():
    from sloserve.step_io import DRAFT_PLACEHOLDER
    d = Drafter(SpeculativeConfig.parse({"method": "layer_skip", "num_speculative_tokens": 3,
                                         "num_draft_layers": 8}))
    assert d.propose("r", [1, 2, 3], 2, 8) == [DRAFT_PLACEHOLDER] * 3
    assert d.propose("r", [1, 2, 3], 2, 2) == [DRAFT_PLACEHOLDER] * 2


def test_a_request_below_the_acceptance_floor_gets_no_drafts_for_a_window():
    """min_acceptance_rate 0.25: a window of 32 draft tokens with 7 accepted stops the
    request's drafts for its next 32 output tokens; 8 of 32 keeps them; other requests are
    not touched; finish forgets the request."""
    from sloserve.config import ACCEPTANCE_WINDOW as W
    d = Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_max": 2, "min_acceptance_rate": 0.25}))
    toks = [4, 5, 6, 7, 8, 9, 4, 5]

    def drafts(rid, outputs):  # a prompt of 6 tokens, ``outputs`` output tokens
        return d.propose(rid, toks[:6] + list(range(100, 98 + outputs)) + toks[6:], 6, 8)
    for _ in range(W // 4 - 1):
        d.observe("low", 4, 1, 10)
        d.observe("ok", 4, 1, 10)
    d.observe("low", 4, 0, 10)     # 7 of 32
    d.observe("ok", 4, 1, 10)      # 8 of 32
    assert drafts("low", 10) == [] and drafts("low", 10 + W - 1) == []
    assert drafts("low", 10 + W) == [6, 7, 8, 9]  # after 10 + W output tokens: again
    assert drafts("ok", 10) == [6, 7, 8, 9] and drafts("other", 10) == [6, 7, 8, 9]
    d.finish("low")
    assert drafts("low", 10) == [6, 7, 8, 9]
    off = Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_max": 2, "min_acceptance_rate": 0}))
    for _ in range(W):
        off.observe("r", 4, 0, 10)
    assert off.propose("r", toks, 2, 8) == [6, 7, 8, 9]


def test_k_per_request_from_its_acceptance_and_the_measured_cost_of_drafts():
    """With the worker's measurement (a step of T query tokens over a decode, T = 1, 2, 3, 5,
    9, 16; figures of the AMX host and of the same host limited to AVX2) each request takes
    the k maximising 1 + a + ... + a^k over the step's relative cost at its estimated
    acceptance a (prior 0.6), none below a gain of 1.15; the quantized limit caps every step."""
    from sloserve.spec_decode.drafter import expected_tokens
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "prompt_lookup_max": 3})
    amx = Drafter(c, 16, [1.0, 1.04, 1.05, 1.16, 1.53, 2.26])
    assert amx.cost(4) == pytest.approx(1.105) and amx.cost(7) == pytest.approx(1.345)
    assert amx.ratios(2)[1] == pytest.approx(1.105 / 1.04)
    assert [amx.k_for(b) for b in (1, 2, 8, 9, 16)] == [4, 4, 1, 0, 0]  # 9 x 2 > 16
    assert (amx.best_k(1, 0.6), amx.best_k(8, 0.6), amx.best_k(8, 0.95)) == (4, 0, 1)
    assert amx.min_acceptance_rate == 0  # adaptive: no fixed floor unless given
    avx2 = Drafter(c, 512, [1.0, 1.17, 1.40, 1.78, 2.65, 4.15])
    assert (avx2.best_k(1, 0.6), avx2.best_k(1, 0.88), avx2.best_k(1, 0.2)) == (2, 4, 0)
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4
    # a request whose drafts are rejected falls to no drafts, for a window, then from the prior
    from sloserve.config import ACCEPTANCE_WINDOW as W
    toks = [4, 5, 6, 7, 8, 9, 4, 5]
    assert avx2.propose("r", toks, 2, 8) == [6, 7]         # k = 2 at the prior
    for _ in range(4):
        avx2.observe("r", 2, 0, 6)
    assert avx2.propose("r", toks, 2, 8) == []              # rate ~0.2: off ...
    assert avx2.propose("r", toks + [1] * (W - 1), 2, 40) == []
    assert avx2.propose("r", toks + [1] * W, 2, 40) != []  # ... for W output tokens
    for _ in range(6):
        avx2.observe("hi", 4, 4, 10)
    assert avx2.propose("hi", toks, 2, 8) == [6, 7, 8, 9]  # k = 4
    # a model drafter's passes count: each draft token adds one pass over the batch
    model = Drafter(c, 16, [1.0, 1.04, 1.05, 1.16, 1.53, 2.26], draft_pass_cost=0.5)
    assert model.ratios(1)[2] == pytest.approx(1.05 + 2 * 0.5)
    assert (model.best_k(1, 0.6), model.best_k(1, 0.95)) == (0, 4)
    # a table or a floor given wins
    fixed = SpeculativeConfig.parse(dict(c.to_dict(), min_acceptance_rate=0.3,
                                         num_speculative_tokens_per_batch_size=[[1, 64, 4]]))
    d = Drafter(fixed, 512, [1.0, 1.17, 1.40, 1.78, 2.65, 4.15])
    assert d.k_for(8) == 4 and d.min_acceptance_rate == 0.3 and not d.adaptive


def test_the_spec_decoding_log_line_comes_on_time_when_the_engine_goes_idle():
    """vLLM's "SpecDecoding metrics" line covers each 10 s interval with drafts: a step's
    stats inside the interval only add up; the server's idle ticks log the interval once it is
    over (the last drafts of a busy stretch are not held back until the next request), and an
    interval without drafts logs nothing."""
    from sloserve.engine.metrics import IterationStats, SpecDecodingLogger, SpecDecodingStats

    class Log:
        lines: list[str] = []

        def info(self, fmt, line):
            self.lines.append(line)
    now = [0.0]
    log = Log()
    sl = SpecDecodingLogger(log, 2, interval_s=10.0, clock=lambda: now[0])
    sd = SpecDecodingStats()
    sd.observe(2, 1)
    now[0] = 3.0
    sl.record(IterationStats(spec_decoding=sd), [])
    sl.tick()
    assert log.lines == []
    now[0] = 10.5
    sl.tick()  # idle: no step since
    assert len(log.lines) == 1 and "Accepted: 1 tokens, Drafted: 2 tokens" in log.lines[0]
    now[0] = 30.0
    sl.tick()
    assert len(log.lines) == 1
