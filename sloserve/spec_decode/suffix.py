"""The suffix proposer (SuffixDecoding, Oliaro et al. 2024, as vLLM's ``suffix`` method on
Arctic Inference's suffix cache): drafts are the most frequent continuations of suffixes of the
request's tokens in two kinds of suffix trees. Plain Python, no model.

Trees. Each is a suffix trie truncated at ``max_tree_depth`` (D): every substring of at most D
tokens of the indexed sequences is a path from the root, and a node counts the indexed
occurrences that pass through it (the root: every indexed position).

* one tree per active request over its own tokens, prompt then output as one sequence (as
  Arctic's per-request tree: the prompt, extended with each output token), built at its first
  :meth:`SuffixProposer.propose`;
* one global tree over the outputs (``token_ids[num_prompt_tokens:]``) of the active requests
  and of the last ``max_cached_requests`` finished ones (0: no global tree). When one more
  request finishes, the oldest cached output is removed (counts go down, nodes left without an
  occurrence go), so the tree holds at most the active + ``max_cached_requests`` outputs.

Tokens are indexed as :meth:`~SuffixProposer.propose` sees the list grow; a list that is shorter
than what was indexed, whose indexed prefix changed, or whose prompt length changed rebuilds
that request's state (its output leaves the global tree first).

Draft (``_Tree.speculate``: Arctic's path speculation). The pattern is the last D tokens. For a
match of m tokens (the pattern's last m are a path from the root, and it goes on), walk down
from its end: take the child with the highest count (ties: the smallest token id); the running
probability multiplies by count(child) / count(node) (the node's count includes the occurrences
that end there: the request's own newest occurrence dilutes, as in Arctic); stop before a token
whose probability would fall under ``min_token_prob``, at ``min(k, floor(max_spec_factor * m))``
tokens (Arctic's rule with ``max_spec_offset`` 0, as vLLM calls it: no floor of 1, a factor
under 1/m drafts nothing), or where the tree's depth ends (a match of m leaves D - m). The
score is the sum of the drafted tokens' probabilities. As in Arctic every match length is a
candidate and the best score wins, the longer match on a tie (the longest match alone would
leave a single token wherever the pattern runs through a long repeat: m = D - 1). The longest m
is found by binary search (a suffix that occurs and goes on is followed by every shorter one);
shorter ones are drafted only while their cap ``min(k, floor(factor * m), D - m)`` could beat
the best score, and not where the match has as many occurrences as the one a token longer (the
same occurrences, so the same continuations, unless the longer one was cut by the depth).
Between the trees the request's own wins a tie. Deterministic: no randomness, no ties left to
dict order.

Layout. Below a node with one occurrence the trie is a chain along that occurrence; such a chain
is one ``_Tail`` (its sequence's token list, the position of its first token, its first depth)
that reads the tokens from the list (and grows with an active sequence). Explicit nodes
(``_Node``: count, child dict or None, best child) appear where a second occurrence arrives (a
tail's head splits off); where a removal leaves a node with one occurrence, which goes on in a
tail, the node folds back into the tail (one whose occurrence ends at the node stays explicit
until that occurrence is removed too). Both use ``__slots__`` (56 and 64 bytes; a child dict
~220). Measured (CPython 3.11, D = 24, 4 x 5,000 tokens in one tree): text that does not recur
(uniform or Zipf tokens of a 32k vocabulary) takes 1 tail + 0.15-0.3 nodes, 170-210 bytes per
indexed token, token list included (the uncompressed trie would have ~23 nodes per token); text
that recurs in full takes up to D - 1 nodes (~270 bytes each) per distinct position, shared by
its occurrences (a 500-token passage 4 times: 1.6 kB per indexed token).

Cost. Indexing a token: each of the sequence's up to D - 1 suffixes still shorter than D moves
on from where it stopped (its cursor: the deepest explicit node on its path), except those that
end in their own tail (it grows by itself; a split or fold of that tail flags the cursor): O(D)
at worst, a few steps on text that does not recur. A removal walks each of the sequence's
suffixes until its occurrence is alone: O(n D) at worst. A draft: the walks for the pattern's
suffixes that lie in the request's own sequence (all of them in its own tree, those within the
output in the global one) start at those cursors (about one step), others at the root (O(m));
O(log D) of them find the longest match, then each candidate tried drafts in O(k) (a node's
best child is kept up to date as counts grow and found again after a removal)."""
from __future__ import annotations

from collections import deque

import numpy as np


class _Node:
    """An explicit trie node: ``count`` occurrences pass through it (0: removed from its tree;
    a sequence's cursor that still points here restarts from the root); ``best``: the token of
    its child with the highest count, the smallest such token (None: unknown, or no child)."""
    __slots__ = ("count", "kids", "best")

    def __init__(self, count: int):
        self.count = count
        self.kids: dict | None = None  # token -> _Node | _Tail
        self.best: int | None = None


class _Tail:
    """A chain of count-1 trie nodes along one occurrence: tokens ``seq[start:]`` at depths
    ``depth``, ``depth + 1``, ... up to the tree's depth or the sequence's end. ``cursor``: the
    cursor of its occurrence while that still grows and ends in this tail (else None)."""
    __slots__ = ("seq", "start", "depth", "cursor")
    count = 1

    def __init__(self, seq: list, start: int, depth: int):
        self.seq, self.start, self.depth = seq, start, depth
        self.cursor: list | None = None


class _Seq:
    """A sequence indexed in a tree: its tokens (tails read them) and, for each start whose
    occurrence is shorter than the depth (it grows with the next token), in start order, a
    cursor ``[start, node, depth, tail]``: the deepest explicit node on its path and its depth,
    and the tail the occurrence ends in (it grows with the tokens: nothing to do), or None
    (it ends at ``node``, or its tail was split or folded: walk on from ``node``)."""
    __slots__ = ("tokens", "cursors")

    def __init__(self):
        self.tokens: list[int] = []
        self.cursors: deque = deque()


class _Tree:
    """A suffix trie truncated at ``depth`` over a changing set of sequences."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node(0)

    # ---------------------------------------------------------------- indexing
    def extend(self, seq: _Seq, new_tokens) -> None:
        """Append ``new_tokens`` to ``seq``: count every new substring of at most
        ``depth`` tokens that ends in them."""
        if not new_tokens:
            return
        D, root, toks = self.depth, self.root, seq.tokens
        n_old = len(toks)
        toks.extend(new_tokens)  # the tails of seq now cover the new tokens
        n = len(toks)
        root.count += n - n_old
        cursors = seq.cursors
        cursors.extend([i, root, 0, None] for i in range(n_old, n))
        for cur in cursors:
            if cur[3] is not None:  # in its own tail, which grew with the tokens
                continue
            i, node, d, _ = cur
            counted = n_old - i if i < n_old else 0  # depths already counted for start i
            target = n - i
            if target > D:
                target = D
            if node.count == 0:  # folded into a tail by a removal
                node, d = root, 0
            while d < target:
                tok = toks[i + d]
                kids = node.kids
                kid = kids.get(tok) if kids is not None else None
                if kid is None:  # the occurrence is alone from here: a tail
                    tail = _Tail(toks, i + d, d + 1)
                    if target < D:
                        tail.cursor, cur[3] = cur, tail
                    if kids is None:
                        node.kids = {tok: tail}
                        node.best = tok
                        break
                    b = node.best
                    if b is not None and tok < b and kids[b].count == 1:
                        node.best = tok
                    kids[tok] = tail
                    break
                if kid.__class__ is _Node:
                    d += 1
                    if d > counted:
                        c = kid.count = kid.count + 1
                        b = node.best
                        if b != tok and b is not None:
                            bc = kids[b].count
                            if c > bc or (c == bc and tok < b):
                                node.best = tok
                    node = kid
                    continue
                if kid.seq is toks and kid.start == i + d:  # its own tail: it grew
                    if target < D:
                        kid.cursor, cur[3] = cur, kid
                    break
                # another occurrence's tail: its head becomes a node of both
                if kid.cursor is not None:  # that occurrence walks on at its next token
                    kid.cursor[3] = kid.cursor = None
                split = _Node(2)
                rest = kid.start + 1
                if rest < len(kid.seq) and d + 2 <= D:
                    split.kids = {kid.seq[rest]: _Tail(kid.seq, rest, d + 2)}
                    split.best = kid.seq[rest]
                kids[tok] = split
                b = node.best
                if b != tok and b is not None:
                    bc = kids[b].count
                    if bc < 2 or (bc == 2 and tok < b):
                        node.best = tok
                node, d = split, d + 1
            cur[1], cur[2] = node, d
        while cursors and n - cursors[0][0] >= D:  # at the full depth: no longer grows
            tail = cursors.popleft()[3]
            if tail is not None:
                tail.cursor = None

    def remove(self, seq: _Seq) -> None:
        """Uncount every occurrence of ``seq``; nodes left without one go, nodes left with one
        that goes on in a tail fold into it."""
        D, root, toks = self.depth, self.root, seq.tokens
        n = len(toks)
        for i in range(n):
            root.count -= 1
            target = min(D, n - i)
            node, d = root, 0
            path = []  # (parent, token, node, depth) of the explicit nodes left counted
            while d < target:
                tok = toks[i + d]
                kids = node.kids
                kid = kids[tok]
                if node.best == tok:
                    node.best = None  # found again when needed
                if kid.__class__ is _Tail or kid.count == 1:  # its own tail / its last count
                    if kid.__class__ is _Node:
                        kid.count = 0
                    del kids[tok]
                    if not kids:
                        node.kids = None
                    break
                kid.count -= 1
                d += 1
                path.append((node, tok, kid, d))
                node = kid
            for parent, tok, node, d in reversed(path):
                kids = node.kids
                if node.count != 1 or kids is None or len(kids) != 1:
                    break
                (kid,) = kids.values()
                if kid.__class__ is not _Tail:
                    break
                parent.kids[tok] = _Tail(kid.seq, kid.start - 1, d)  # the same count: 1
                node.count, node.kids, node.best = 0, None, None
                if kid.cursor is not None:  # that occurrence walks again from the root
                    kid.cursor[3] = kid.cursor = None
        self.close(seq)

    def close(self, seq: _Seq) -> None:
        """``seq`` grows no more (it must not be extended after): drop its cursors."""
        for cur in seq.cursors:
            if cur[3] is not None:
                cur[3].cursor = None
        seq.cursors.clear()

    # ---------------------------------------------------------------- drafting
    def _tail_len(self, tail: _Tail) -> int:
        return min(self.depth - tail.depth + 1, len(tail.seq) - tail.start)

    def _match(self, pattern: list, start: int, node: _Node):
        """Where ``pattern[start:]`` ends as a path from ``node``: ``(node, None, 0)`` at an
        explicit node, ``(parent, tail, pos)`` inside a tail (``pos``: the index in
        ``tail.seq`` of the token that would come next), or None."""
        size, p = len(pattern), start
        while p < size:
            kids = node.kids
            kid = kids.get(pattern[p]) if kids is not None else None
            if kid is None:
                return None
            p += 1
            if kid.__class__ is _Node:
                node = kid
                continue
            pos, rest = kid.start + 1, size - p  # the rest of the pattern lies in the tail
            if rest >= self._tail_len(kid) or kid.seq[pos:pos + rest] != pattern[p:]:
                return None
            return node, kid, pos + rest
        return node, None, 0

    def _goes_on(self, at) -> bool:
        if at is None:
            return False
        node, tail, pos = at
        if tail is None:
            return node.kids is not None
        return pos < tail.start + self._tail_len(tail)

    def _draft(self, at, most: int, min_prob: float) -> tuple[float, list[int]]:
        """Greedy draft of at most ``most`` tokens from ``at`` (a :meth:`_match` result):
        ``(score, tokens)``."""
        node, tail, pos = at
        out: list[int] = []
        prob, score = 1.0, 0.0
        while tail is None:
            kids = node.kids
            if kids is None or len(out) >= most:
                return score, out
            best_tok = node.best
            if best_tok is None:
                top = max(kid.count for kid in kids.values())
                best_tok = node.best = min(tok for tok, kid in kids.items()
                                           if kid.count == top)
            best = kids[best_tok]
            prob *= best.count / node.count
            if prob < min_prob:
                return score, out
            out.append(best_tok)
            score += prob
            if best.__class__ is _Node:
                node = best
            else:
                tail, pos = best, best.start + 1
        # a tail: count 1 all along, the probability stays
        take = min(most - len(out), tail.start + self._tail_len(tail) - pos)
        if take > 0:
            out.extend(tail.seq[pos:pos + take])
            score += prob * take
        return score, out

    def speculate(self, pattern: list, k: int, factor: float, min_prob: float,
                  seq: _Seq | None = None) -> tuple[float, list[int]]:
        """The best-scoring draft over the match lengths of ``pattern``'s suffixes:
        ``(score, tokens)``; ``(0.0, [])`` without a match that goes on. ``seq``: a sequence
        of this tree that ``pattern`` ends (its cursors are where the pattern's suffixes that
        lie in it end: the walks start there, not at the root)."""
        D, size, root = self.depth, len(pattern), self.root
        cursors = seq.cursors if seq is not None else ()
        ncur = len(cursors)  # the cursors of the starts len(seq.tokens) - ncur, ..., - 1

        def at(m: int):
            if m <= ncur:
                node, d = cursors[ncur - m][1:3]
                if node.count:  # else folded into a tail by a removal
                    return self._match(pattern, size - m + d, node)
            return self._match(pattern, size - m, root)

        lo, hi = 0, min(size, D - 1)
        while lo < hi:  # the longest suffix that occurs and goes on
            mid = (lo + hi + 1) // 2
            if self._goes_on(at(mid)):
                lo = mid
            else:
                hi = mid - 1
        best_score, best = 0.0, []
        prev_count, prev_free = -1, False
        for m in range(lo, 0, -1):
            cap = min(k, int(m * factor + 1e-6))
            if cap <= best_score:  # shorter matches have no higher cap
                break
            where = at(m)
            count = where[0].count if where[1] is None else 1
            # as many occurrences as the match one longer: the same ones, so the same
            # continuations; where that draft was not cut by the depth, this one is no better
            same = prev_free and count == prev_count
            prev_count, prev_free = count, D - m >= cap
            most = min(cap, D - m)
            if same or most <= best_score:
                continue
            score, out = self._draft(where, most, min_prob)
            if score > best_score:
                best_score, best = score, out
        return best_score, best

    # ---------------------------------------------------------------- inspection
    def stats(self) -> tuple[int, int, int]:
        """(explicit nodes, tails, trie nodes as if uncompressed), the root not counted."""
        nodes = tails = trie = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for kid in (node.kids or {}).values():
                if kid.__class__ is _Node:
                    nodes += 1
                    trie += 1
                    stack.append(kid)
                else:
                    tails += 1
                    trie += self._tail_len(kid)
        return nodes, tails, trie

    def counts(self) -> dict[tuple, int]:
        """Every trie path (a token tuple) with its count, tails expanded (for tests)."""
        out: dict[tuple, int] = {}
        stack = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for tok, kid in (node.kids or {}).items():
                if kid.__class__ is _Node:
                    out[path + (tok,)] = kid.count
                    stack.append((path + (tok,), kid))
                else:
                    for o in range(self._tail_len(kid)):
                        out[path + tuple(kid.seq[kid.start:kid.start + o + 1])] = 1
        return out


class _Request:
    """A request's state: its own tree and its sequences there and in the global tree."""
    __slots__ = ("num_prompt_tokens", "tree", "seq", "out_seq")

    def __init__(self, num_prompt_tokens: int, depth: int):
        self.num_prompt_tokens = num_prompt_tokens
        self.tree = _Tree(depth)
        self.seq = _Seq()  # prompt + output, in the request's own tree
        self.out_seq: _Seq | None = None  # output, in the global tree


class SuffixProposer:
    """SuffixDecoding drafts (see the module's notes).

    Args:
        max_tree_depth: D, the longest substring indexed (and pattern matched).
        max_cached_requests: finished requests whose outputs stay in the global tree (0: no
            global tree; drafts come from the request's own tokens only).
        max_spec_factor: at most ``floor(max_spec_factor * m)`` drafts for a match of m tokens.
        min_token_prob: a draft stops before a token whose estimated probability (the product
            of count ratios down the tree) is under this.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1):
        if max_tree_depth < 1:
            raise ValueError("max_tree_depth must be >= 1")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max(0, max_cached_requests)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _Request] = {}
        self._global = _Tree(max_tree_depth) if self.max_cached_requests > 0 else None
        self._cached: deque[_Seq] = deque()  # finished outputs in the global tree, oldest first

    def propose(self, request_id: str, token_ids, num_prompt_tokens: int, k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``token_ids`` (the request's prompt, its first
        ``num_prompt_tokens``, then its output); indexes the tokens not seen before."""
        if not isinstance(token_ids, list):
            token_ids = (token_ids.tolist() if isinstance(token_ids, np.ndarray)
                         else [int(t) for t in token_ids])
        req = self._sync(request_id, token_ids, num_prompt_tokens)
        if k <= 0:
            return []
        pattern = token_ids[-self.max_tree_depth:]
        args = (k, self.max_spec_factor, self.min_token_prob)
        score, draft = req.tree.speculate(pattern, *args, req.seq)
        if self._global is not None:
            other_score, other = self._global.speculate(pattern, *args, req.out_seq)
            if other_score > score:
                draft = other
        return draft

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted: its own tree goes; its output stays in the
        global tree among the last ``max_cached_requests`` finished (no-op if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None or req.out_seq is None:
            return
        self._global.close(req.out_seq)
        self._cached.append(req.out_seq)
        while len(self._cached) > self.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def stats(self) -> dict:
        """Active and cached requests and the global tree's size (walks the tree: slow)."""
        nodes, tails, trie = self._global.stats() if self._global is not None else (0, 0, 0)
        return {"active_requests": len(self._requests), "cached_requests": len(self._cached),
                "global_nodes": nodes, "global_tails": tails, "global_trie_nodes": trie}

    def _sync(self, request_id: str, token_ids: list, num_prompt_tokens: int) -> _Request:
        req = self._requests.get(request_id)
        if req is not None:
            seen = req.seq.tokens
            n = len(seen)
            if (num_prompt_tokens != req.num_prompt_tokens or len(token_ids) < n
                    or (token_ids if len(token_ids) == n else token_ids[:n]) != seen):
                if req.out_seq is not None:
                    self._global.remove(req.out_seq)
                req = None
        if req is None:
            req = self._requests[request_id] = _Request(num_prompt_tokens, self.max_tree_depth)
            if self._global is not None:
                req.out_seq = _Seq()
            n = 0
        if len(token_ids) > n:
            req.tree.extend(req.seq, token_ids[n:])
            if req.out_seq is not None:
                self._global.extend(req.out_seq, token_ids[max(n, num_prompt_tokens):])
        return req
