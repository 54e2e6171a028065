"""The suffix proposer (SuffixDecoding): exact drafts on crafted token lists, the global tree's
cache and eviction, and the compressed trie against a brute-force one (no model)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from sloserve.config import SpeculativeConfig
from sloserve.spec_decode.drafter import Drafter
from sloserve.spec_decode.suffix import SuffixProposer, _Seq, _Tree


def proposer(depth=8, cached=16, factor=1.0, min_prob=0.1) -> SuffixProposer:
    return SuffixProposer(max_tree_depth=depth, max_cached_requests=cached,
                          max_spec_factor=factor, min_token_prob=min_prob)


def run(p, rid, prompt, output, k=4, finish=False):
    """Propose after each output token (as the engine does); the last draft."""
    draft = None
    for n in range(len(output) + 1):
        draft = p.propose(rid, prompt + output[:n], len(prompt), k)
    if finish:
        p.finish(rid)
    return draft


PROMPT = [10, 11, 12, 13, 14, 15, 20, 21]


def test_repeats_a_phrase_seen_in_the_prompt():
    # [10, 11, 12] occurs in the prompt and (the newest) at the end: count 2, so each drafted
    # token has probability 1/2; 3 tokens matched allow 3 drafts (factor 1)
    assert proposer().propose("r", PROMPT + [10, 11, 12], 8, 5) == [13, 14, 15]
    # 4 matched: 4 more, what follows in the prompt
    assert proposer().propose("r", PROMPT + [10, 11, 12, 13], 8, 5) == [14, 15, 20, 21]
    # grown one token at a time, as the engine calls it: the same
    assert run(proposer(), "r", PROMPT, [10, 11, 12, 13], k=5) == [14, 15, 20, 21]
    # nothing in the prompt follows the tokens: no draft
    assert proposer().propose("r", PROMPT + [30, 31], 8, 5) == []
    assert proposer().propose("r", [], 0, 5) == []


def test_respects_k_the_spec_factor_and_the_tree_depth():
    toks = PROMPT + [10, 11, 12]
    assert proposer().propose("r", toks, 8, 2) == [13, 14]  # k
    assert proposer().propose("r", toks, 8, 0) == []
    assert proposer(factor=0.5).propose("r", toks, 8, 5) == [13]  # floor(0.5 * 3)
    assert proposer(factor=0.3).propose("r", toks, 8, 5) == []  # floor(0.3 * m) = 0 for m <= 3
    assert proposer(factor=2.0).propose("r", toks, 8, 8) == [13, 14, 15, 20, 21]  # depth 8 - 3
    # a copy of a long prompt passage: depth 24 drafts min(k, matched) tokens; depth 4 matches
    # at most 3 tokens, leaving 4 - m to draft: m = 2 gives the most (2)
    prompt, out = list(range(100, 120)), list(range(100, 106))
    assert proposer(depth=24).propose("r", prompt + out, 20, 8) == [106, 107, 108, 109, 110, 111]
    assert proposer(depth=4).propose("r", prompt + out, 20, 8) == [106, 107]
    assert proposer(depth=1).propose("r", prompt + out, 20, 8) == []  # nothing goes on at depth 1


def test_prefers_the_more_probable_continuation():
    # after [7, 8]: 1 twice, 2 once (and the newest occurrence, which ends): 1 with p = 2/4;
    # after [7, 8, 1]: 50 and 52 once each, the smaller token on the tie, p = 1/4
    prompt = [7, 8, 1, 50, 7, 8, 2, 51, 7, 8, 1, 52]
    assert proposer().propose("r", prompt + [99, 7, 8], 12, 4) == [1, 50]
    # a longer match wins where it scores higher: [9, 7, 8] is followed by 2 (p = 1/2 for 3
    # tokens: 1.5) against [7, 8] (1/2 + 1/4 for 2 tokens)
    prompt = [7, 8, 1, 50, 9, 7, 8, 2, 51, 7, 8, 1, 52]
    assert proposer().propose("r", prompt + [9, 7, 8], 13, 4) == [2, 51, 7]
    # ... and a shorter one where it scores higher: [9, 7, 8] goes on with 2, 3 or 4 (1/4 each:
    # 0.75 for 3 tokens) while [7, 8] goes on 5 of 9 times with [1, 60] (5/9 each: 1.11)
    prompt = [21, 9, 7, 8, 2, 22, 9, 7, 8, 3, 23, 9, 7, 8, 4, 24] + [7, 8, 1, 60, 25] * 5
    assert proposer().propose("r", prompt + [99, 9, 7, 8], len(prompt), 4) == [1, 60]
    # (where the same occurrences are preceded by the same token, the match one longer counts:
    # [0, 9, 7, 8] twice, 1/3 each, 4 tokens: 1.33)
    prompt = [9, 7, 8, 2, 0, 9, 7, 8, 3, 0, 9, 7, 8, 4, 0] + [7, 8, 1, 60, 0] * 5
    assert proposer().propose("r", prompt + [9, 7, 8], len(prompt), 4) == [3, 0, 9, 7]


def test_stops_where_the_probability_falls_under_min_token_prob():
    # after [1, 2]: 3 in 4 of 5 occurrences (p = 0.8); after [1, 2, 3]: 7 or 8, half each
    # (p = 0.4 for the second token)
    prompt = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 3, 8]
    toks = prompt + [99, 1, 2]
    assert proposer(min_prob=0.6).propose("r", toks, 16, 4) == [3]
    assert proposer(min_prob=0.3).propose("r", toks, 16, 4) == [3, 7]
    assert proposer(min_prob=0.9).propose("r", toks, 16, 4) == []
    assert proposer(min_prob=0.0).propose("r", toks, 16, 4) == [3, 7]  # m = 2: 2 tokens


def test_uses_other_requests_outputs_through_the_global_tree():
    p = proposer()
    run(p, "a", [1, 2], [30, 31, 32, 33, 34, 35], finish=True)
    # b's prompt has no [30, 31]; a's output does (count 2 with b's own: p = 1/2, 2 tokens)
    assert run(p, "b", [5, 6, 7], [30, 31]) == [32, 33]
    # an active request's output counts too
    p = proposer()
    run(p, "a", [1, 2], [40, 41, 42, 43, 44])
    assert run(p, "b", [5], [40, 41]) == [42, 43]
    assert p.stats()["active_requests"] == 2 and p.stats()["cached_requests"] == 0
    # the prompt (the request's own tree) wins a tie: both score 1/2 + 1/2
    p = proposer()
    run(p, "a", [1], [30, 31, 32, 33], finish=True)
    assert run(p, "b", [30, 31, 50, 51], [30, 31]) == [50, 51]


def test_max_cached_requests_zero_has_no_global_tree():
    p = proposer(cached=0)
    run(p, "a", [1, 2], [30, 31, 32, 33, 34, 35], finish=True)
    assert run(p, "b", [5, 6, 7], [30, 31]) == []
    assert p._global is None and p.stats()["cached_requests"] == 0
    # the request's own output still drafts (its own tree holds prompt and output)
    assert run(p, "c", [5], [60, 61, 62, 63, 60, 61]) == [62, 63]


def test_eviction_removes_the_oldest_finished_output():
    a_out, b_out = [30, 31, 32, 33, 34, 35], [30, 31, 60, 61]
    keep = proposer(cached=2)
    run(keep, "a", [1, 2], a_out, finish=True)
    run(keep, "b", [3], b_out, finish=True)
    # both cached: [30, 31] goes on with 32 (a) or 60 (b), the smaller wins the tie (p = 1/3)
    assert run(keep, "c", [5, 6, 7], [30, 31]) == [32, 33]

    p = proposer(cached=1)
    run(p, "a", [1, 2], a_out, finish=True)
    run(p, "b", [3], b_out, finish=True)  # a is evicted
    only_b = proposer(cached=1)
    run(only_b, "b", [3], b_out, finish=True)
    assert p.stats() == only_b.stats() == {
        "active_requests": 0, "cached_requests": 1, "global_nodes": 0, "global_tails": 4,
        "global_trie_nodes": 10}
    assert run(p, "c", [5, 6, 7], [30, 31]) == [60, 61]  # a's continuation is gone
    assert run(p, "d", [8], [33, 34]) == []
    # a request's own tree goes with it
    p.finish("c")
    p.finish("d")
    assert p.stats()["active_requests"] == 0 and p.stats()["cached_requests"] == 1
    # all evicted: the global tree is empty
    for i in range(3):
        run(p, f"e{i}", [9], [], finish=True)
    assert p.stats() == {"active_requests": 0, "cached_requests": 1, "global_nodes": 0,
                         "global_tails": 0, "global_trie_nodes": 0}
    assert p._global.root.count == 0 and p._global.root.kids is None


def test_finish_of_an_unknown_request_is_a_no_op():
    p = proposer()
    p.finish("nope")
    run(p, "a", [1], [30, 31, 32], finish=True)
    before = p.stats()
    p.finish("a")  # again
    p.finish("nope")
    assert p.stats() == before and before["cached_requests"] == 1


def test_a_token_list_that_changed_rebuilds_the_request():
    p = proposer()
    assert p.propose("r", [1, 2, 3, 4, 1, 2], 4, 3) == [3, 4]
    # the list changed at index 3 (and grew): only the new list counts
    assert p.propose("r", [1, 2, 3, 5, 1, 2, 3], 4, 3) == [5, 1, 2]
    # shorter
    assert p.propose("r", [1, 2, 3, 5, 1, 2], 4, 3) == [3, 5]
    # the prompt length changed: the output in the global tree is the new one
    assert p.propose("r", [1, 2, 3, 5, 1, 2], 2, 3) == [3, 5]
    fresh = proposer()
    fresh.propose("r", [1, 2, 3, 5, 1, 2], 2, 3)
    assert p.stats() == fresh.stats()
    assert p._global.counts() == fresh._global.counts()
    # a numpy array works as a list does
    assert p.propose("r", np.array([1, 2, 3, 5, 1, 2, 3]), 2, 3) == [5, 1, 2]


def test_the_drafter_calls_it_and_finishes_requests():
    cfg = SpeculativeConfig.parse({"method": "suffix", "suffix_decoding_max_tree_depth": 8,
                                   "suffix_decoding_max_cached_requests": 1})
    assert cfg.num_speculative_tokens == 8
    d = Drafter(cfg)
    assert d.propose("a", [1, 2, 30, 31, 32, 33], 2, 4, batch_size=1) == []
    d.finish("a")
    assert d.proposer.stats()["cached_requests"] == 1
    assert d.propose("b", [5, 30, 31], 1, 4, batch_size=1) == [32, 33]


# ------------------------------------------------------------------ against brute force
def brute_counts(seqs, depth):
    out: dict[tuple, int] = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                key = tuple(s[i:i + n])
                out[key] = out.get(key, 0) + 1
    return out


def brute_speculate(seqs, depth, pattern, k, factor, min_prob):
    """Arctic's path speculation on an uncompressed trie: every match length, best score."""
    counts = brute_counts(seqs, depth)
    pattern = pattern[-depth:]
    best = (0.0, [])
    for m in range(len(pattern), 0, -1):
        path = tuple(pattern[len(pattern) - m:])
        if path not in counts:
            continue
        out, prob, score = [], 1.0, 0.0
        while len(out) < min(k, int(m * factor + 1e-6)):
            kids = {p[-1]: c for p, c in counts.items()
                    if len(p) == len(path) + 1 and p[:-1] == path}
            if not kids:
                break
            tok = min(kids, key=lambda t: (-kids[t], t))
            prob *= kids[tok] / counts[path]
            if prob < min_prob:
                break
            out.append(tok)
            score += prob
            path += (tok,)
        if score > best[0]:
            best = (score, out)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_compressed_trie_counts_as_the_brute_force_one(seed):
    """Random appends (one or many tokens), new sequences, closed ones (finished) and removals
    on a small vocabulary (many repeats): the trie's counts, its best children, its cursors and
    its drafts match brute force."""
    for case in range(40):
        rnd = random.Random(seed * 1000 + case)
        depth, vocab = rnd.randint(1, 6), rnd.randint(1, 4)
        tree, live, closed = _Tree(depth), [], []
        for _ in range(rnd.randint(1, 25)):
            r = rnd.random()
            if r < 0.25 or not live:
                live.append(_Seq())
                tree.extend(live[-1], [rnd.randrange(vocab) for _ in range(rnd.randint(0, 8))])
            elif r < 0.7:
                tree.extend(rnd.choice(live), [rnd.randrange(vocab)
                                               for _ in range(rnd.choice([1, 1, 2, 5]))])
            elif r < 0.8:
                closed.append(live.pop(rnd.randrange(len(live))))
                tree.close(closed[-1])
            else:
                pool = rnd.choice([p for p in (live, closed) if p])
                tree.remove(pool.pop(rnd.randrange(len(pool))))
            seqs = [s.tokens for s in live + closed]
            assert tree.counts() == brute_counts(seqs, depth)
            assert tree.root.count == sum(map(len, seqs))
            check_best_children(tree)
            check_cursors(tree, live)
            if live:
                s = rnd.choice(live)
                pattern = (s.tokens[len(s.tokens) - rnd.randint(0, len(s.tokens)):]
                           if rnd.random() < 0.5 else
                           [rnd.randrange(vocab) for _ in range(rnd.randint(0, 4))] + s.tokens)
                k, factor = rnd.randint(0, 6), rnd.choice([0.3, 1.0, 2.0])
                min_prob = rnd.choice([0.0, 0.1, 0.4, 0.6])
                got = tree.speculate(pattern, k, factor, min_prob, s)
                want = brute_speculate(seqs, depth, pattern, k, factor, min_prob)
                assert got[1] == want[1] and got[0] == pytest.approx(want[0])
                assert tree.speculate(pattern, k, factor, min_prob) == got  # walks from the root


def check_cursors(tree, live):
    """A growing sequence has a cursor per start shorter than the depth; a tail and the cursor
    of the occurrence that ends in it point at each other."""
    cursors = {id(c): c for s in live for c in s.cursors}
    for s in live:
        n = len(s.tokens)
        assert [c[0] for c in s.cursors] == list(range(max(0, n - tree.depth + 1), n))
    tails, stack = [], [tree.root]
    while stack:
        for kid in (stack.pop().kids or {}).values():
            (stack if hasattr(kid, "kids") else tails).append(kid)
    for tail in tails:
        assert tail.cursor is None or (id(tail.cursor) in cursors and tail.cursor[3] is tail)
    assert sum(c[3] is not None for c in cursors.values()) == sum(
        t.cursor is not None for t in tails)


def check_best_children(tree):
    stack = [tree.root]
    while stack:
        node = stack.pop()
        if node.kids is None:
            assert node.best is None
            continue
        if node.best is not None:
            top = max(kid.count for kid in node.kids.values())
            assert node.best == min(t for t, kid in node.kids.items() if kid.count == top)
        stack.extend(kid for kid in node.kids.values() if hasattr(kid, "kids"))


def test_distinct_text_keeps_about_one_object_per_token():
    """The trie is compressed: a tail per position of text that does not recur, not a node per
    position and depth; text that recurs in full takes up to depth - 1 nodes per position."""
    rng = np.random.default_rng(0)
    tree = _Tree(24)
    for _ in range(4):
        tree.extend(_Seq(), rng.integers(0, 32000, 2000).tolist())
    nodes, tails, trie = tree.stats()
    # (a position near a sequence's end whose occurrence is not alone ends at a node instead)
    assert 7990 <= tails <= 8000 and nodes < 0.15 * 8000 and trie > 20 * 8000
    tree = _Tree(24)
    passage = list(range(1000, 1100))
    for _ in range(3):
        tree.extend(_Seq(), passage)
    nodes, tails, trie = tree.stats()
    assert tails == 0 and nodes == trie == sum(min(24, 100 - i) for i in range(100))
