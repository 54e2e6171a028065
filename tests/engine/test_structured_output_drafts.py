"""The scheduler's masks for draft positions (``Scheduler._mask_drafts``): each draft the
grammar allows gets the mask of the position after it, the first refused draft and those after
it are cut from the step, a draft that completes the grammar ends the drafts, and the matcher
is rolled back to where it was (``update_from_output`` advances it over the kept tokens)."""
from __future__ import annotations

from sloserve.engine.scheduler import Scheduler
from sloserve.sampling_params import SamplingParams
from sloserve.step_io import ScheduledRequest


class FakeGrammar:
    """Accepts the tokens in ``allowed`` while not terminated; ``ends`` terminates it."""

    def __init__(self, allowed, ends=None):
        self.allowed, self.ends = set(allowed), ends
        self.state: list[int] = []
        self.rolled_back = 0

    def accept(self, tok):
        if tok not in self.allowed or self.is_terminated:
            return False
        self.state.append(tok)
        return True

    @property
    def is_terminated(self):
        return bool(self.state) and self.state[-1] == self.ends

    def fill_bitmask(self):
        return bytes([len(self.state)])  # a stand-in: the mask after this many tokens

    def rollback(self, n):
        self.rolled_back += n
        del self.state[len(self.state) - n:]


def verify_step(drafts):
    return ScheduledRequest("r", 10, 1 + len(drafts), [7] + list(drafts), [0, 1, 2],
                            SamplingParams(), samples=True, is_decode=True,
                            spec_token_ids=list(drafts), token_bitmask=[b"\0"])


def test_drafts_the_grammar_refuses_are_cut_and_the_matcher_rolls_back():
    g = FakeGrammar({1, 2, 3, 5})
    sr = verify_step([1, 2, 4, 5])  # 4 is refused: it and 5 are cut
    Scheduler._mask_drafts(sr, g)
    assert sr.spec_token_ids == [1, 2] and sr.token_ids == [7, 1, 2]
    assert sr.num_new_tokens == 3 and sr.token_bitmask == [b"\0", b"\1", b"\2"]
    assert g.state == [] and g.rolled_back == 2


def test_a_draft_that_completes_the_grammar_ends_the_drafts():
    g = FakeGrammar({1, 2, 3}, ends=2)
    sr = verify_step([1, 2, 3])
    Scheduler._mask_drafts(sr, g)
    assert sr.spec_token_ids == [1, 2] and sr.num_new_tokens == 3
    assert sr.token_bitmask == [b"\0", b"\1"]  # no mask after the end: nothing is kept there
    assert g.state == []


def test_all_drafts_allowed_and_none():
    g = FakeGrammar({1, 2})
    sr = verify_step([1, 2])
    Scheduler._mask_drafts(sr, g)
    assert sr.spec_token_ids == [1, 2] and len(sr.token_bitmask) == 3 and g.rolled_back == 2
    g = FakeGrammar(set())
    sr = verify_step([1, 2])
    Scheduler._mask_drafts(sr, g)
    assert sr.spec_token_ids == [] and sr.token_ids == [7] and sr.num_new_tokens == 1
    assert g.rolled_back == 0
