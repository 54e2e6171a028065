"""The n-gram proposer and ``--speculative-config``'s checks (no model)."""
from __future__ import annotations

import pytest

from sloserve.config import EngineConfig
from sloserve.engine.request import Request, RequestStatus
from sloserve.sampling_params import SamplingParams
from sloserve.spec_decode.config import SpeculativeConfig
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


def _req(prompt, out, max_tokens=None, grammar=None, status=RequestStatus.RUNNING):
    r = Request("r", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))
    r.output_token_ids = list(out)
    r.num_computed_tokens = r.num_tokens - 1
    r.status, r.grammar = status, grammar
    return r


def test_drafts_go_to_decoding_requests_within_max_tokens():
    d = Drafter(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2}))
    a = _req([4, 5, 6, 7, 8, 4], [5], max_tokens=10)
    b = _req([4, 5, 6, 7, 8, 4], [5], max_tokens=3)     # 2 of 3 output tokens left: 1 draft
    c = _req([4, 5, 6, 7, 8, 4], [5], max_tokens=2)     # its last token: none
    g = _req([4, 5, 6, 7, 8, 4], [5], grammar=object())  # a grammar: none
    w = _req([4, 5, 6, 7, 8, 4], [5], status=RequestStatus.WAITING)
    pre = _req([4, 5, 6, 7, 8, 4], [5])
    pre.num_computed_tokens = 2                          # still prefilling: none
    d.propose([a, b, c, g, w, pre])
    assert [r.spec_token_ids for r in (a, b, c, g, w, pre)] == [[6, 7, 8], [6], [], [], [], []]


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ([1], "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of ngram"),
    ({"method": "ngram", "prompt_lookup_max": 2}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}, "in [1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": 2}, "needs prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min (3) is over prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": True}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "k": 1},
     "unknown key(s) k"),
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
