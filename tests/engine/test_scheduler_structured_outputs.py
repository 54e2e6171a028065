"""The scheduler owns structured outputs: it gives a request its grammar, holds it while the
grammar compiles, fills its token bitmask when it samples, advances its matcher over the sampled
tokens and finishes it (a completed grammar: ``stop``; a refused token, a broken matcher or a
grammar that failed to compile: ``abort``), and releases the grammar when the request finishes
however it finishes (so that a compile nobody waits for stops). A fake manager stands in for xgrammar, so these
run without it; the scheduler module itself imports neither xgrammar nor torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import fake_runner_output, make_request, make_scheduler
from sloserve.engine.request import RequestStatus
from sloserve.sampling_params import StructuredOutputsParams

ALLOWED = b"\x01" * 8


class FakeGrammar:
    """Accepts the tokens in ``accepts`` (in any order), completes after ``complete_after`` of
    them; ``mask`` is what fill_bitmask returns (an exception instance: it raises it)."""

    def __init__(self, accepts=(), complete_after=None, mask=ALLOWED, ready=True, error=None,
                 bad_request=False):
        self.accepts, self.complete_after = set(accepts), complete_after
        self.mask, self.ready, self.error = mask, ready, error
        self.bad_request = bad_request
        self.accepted: list[int] = []
        self.released = 0

    def release(self) -> None:
        self.released += 1

    def fill_bitmask(self) -> bytes:
        if isinstance(self.mask, Exception):
            raise self.mask
        return self.mask

    def accept(self, tok: int) -> bool:
        if tok not in self.accepts:
            return False
        self.accepted.append(tok)
        return True

    @property
    def is_terminated(self) -> bool:
        return self.complete_after is not None and len(self.accepted) >= self.complete_after


class FakeManager:
    def __init__(self, grammar: FakeGrammar):
        self.grammar, self.specs = grammar, []

    def grammar_for(self, spec):
        self.specs.append(spec)
        return self.grammar


SPEC = StructuredOutputsParams(regex="[ab]+")


def scheduler_with(grammar: FakeGrammar):
    s = make_scheduler()
    s.structured_output_manager = FakeManager(grammar)
    return s


def structured(rid="r", n_prompt=5, max_tokens=8, **kw):
    return make_request(rid, n_prompt, max_tokens, structured_outputs=SPEC, **kw)


def step(s, tokens: dict[str, list[int]]):
    out = s.schedule(0.0)
    ro = fake_runner_output(s, out)
    ro.sampled_token_ids = [tokens.get(sr.request_id, [])
                            if sr.samples else []
                            for sr in out.scheduled]
    return out, {o.request_id: o for o in s.update_from_output(out, ro, 1.0)}


def test_the_grammar_comes_from_the_manager_and_its_mask_goes_with_the_step():
    g = FakeGrammar(accepts={7})
    s = scheduler_with(g)
    s.add_request(structured())
    assert s.structured_output_manager.specs == [SPEC] and s.requests["r"].grammar is g
    out, outs = step(s, {"r": [7]})
    assert [sr.token_bitmask for sr in out.scheduled] == [[ALLOWED]]
    assert outs["r"].new_token_ids == [7] and not outs["r"].finished and g.accepted == [7]


def test_a_request_waits_while_its_grammar_compiles():
    g = FakeGrammar(accepts={7}, ready=False)
    s = scheduler_with(g)
    s.add_request(structured())
    s.add_request(make_request("plain", 5))
    out = s.schedule(0.0)
    assert [sr.request_id for sr in out.scheduled] == ["plain"]
    g.ready = True
    out = s.schedule(0.0)
    assert "r" in [sr.request_id for sr in out.scheduled]


def test_a_grammar_that_failed_to_compile_finishes_its_request_at_the_next_schedule():
    g = FakeGrammar(ready=False)
    s = scheduler_with(g)
    s.add_request(structured())
    assert s.schedule(0.0).is_empty and s.take_finished_outputs() == []
    g.ready, g.error = True, "ValueError: bad"
    assert s.schedule(0.0).is_empty
    [o] = s.take_finished_outputs()
    assert (o.request_id, o.finish_reason, o.error) == ("r", "abort",
                                                        "grammar compilation failed: ValueError: bad")
    assert not s.has_unfinished() and s.take_finished_outputs() == []


def test_a_grammar_over_its_compile_limit_fails_its_request_as_a_bad_request():
    g = FakeGrammar(ready=False)
    s = scheduler_with(g)
    s.add_request(structured())
    s.add_request(make_request("plain", 5))
    assert [sr.request_id for sr in s.schedule(0.0).scheduled] == ["plain"]
    g.ready, g.error, g.bad_request = True, "over the limit (--flag 1)", True
    s.schedule(0.0)
    [o] = s.take_finished_outputs()
    assert (o.request_id, o.bad_request, o.error) == (
        "r", True, "grammar compilation failed: over the limit (--flag 1)")
    assert list(s.requests) == ["plain"] and g.released == 1


@pytest.mark.parametrize("how", ["abort", "finish"])
def test_a_finished_request_releases_its_grammar_once(how):
    g = FakeGrammar(accepts={7}, complete_after=1, ready=False)
    s = scheduler_with(g)
    s.add_request(structured())
    s.schedule(0.0)  # still compiling: waits
    assert g.released == 0
    if how == "abort":  # the client went away while it compiled
        s.finish_request("r", RequestStatus.FINISHED_ABORTED)
    else:
        g.ready = True
        _, outs = step(s, {"r": [7]})
        assert outs["r"].finish_reason == "stop"
    assert g.released == 1 and not s.has_unfinished()
    s.finish_request("r", RequestStatus.FINISHED_ABORTED)  # unknown now: nothing more
    assert g.released == 1


def test_a_completed_grammar_stops_the_request_even_with_ignore_eos():
    g = FakeGrammar(accepts={7, 8}, complete_after=2)
    s = scheduler_with(g)
    s.add_request(structured(ignore_eos=True))
    _, outs = step(s, {"r": [7]})
    assert not outs["r"].finished
    _, outs = step(s, {"r": [8]})
    o = outs["r"]
    assert (o.finish_reason, o.stop_reason, o.new_token_ids, o.error) == ("stop", 8, [8], None)
    assert not s.has_unfinished() and s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_a_refused_token_aborts_the_request_alone():
    g = FakeGrammar(accepts={7})
    s = scheduler_with(g)
    s.add_request(structured())
    s.add_request(make_request("plain", 5))
    _, outs = step(s, {"r": [9], "plain": [1000]})
    o = outs["r"]
    assert (o.finish_reason, o.error, o.bad_request) == (
        "abort", "structured output: token 9 is outside the request's grammar", False)
    assert not outs["plain"].finished and list(s.requests) == ["plain"]


@pytest.mark.parametrize("mask,why,bad_request", [
    (b"\0" * 8, "structured output: no token can continue the output under its grammar (the "
                "spec cannot be satisfied)", True),
    (RuntimeError("matcher"), "structured output failed: RuntimeError: matcher", False)])
def test_a_broken_grammar_runs_its_step_without_a_mask_then_aborts(mask, why, bad_request):
    g = FakeGrammar(accepts={7}, mask=mask)
    s = scheduler_with(g)
    s.add_request(structured())
    out, outs = step(s, {"r": [7]})
    assert out.scheduled[0].token_bitmask == [] and g.accepted == []
    o = outs["r"]
    assert (o.finish_reason, o.error, o.bad_request, o.new_token_ids) == ("abort", why,
                                                                          bad_request, [7])
    assert not s.has_unfinished()


def test_a_spec_without_a_manager_is_refused():
    s = make_scheduler()
    with pytest.raises(ValueError, match="structured-output manager"):
        s.add_request(structured())
    assert not s.has_unfinished()


def test_the_scheduler_module_imports_neither_xgrammar_nor_torch():
    code = ("import sys, sloserve.engine.scheduler; "
            "print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
