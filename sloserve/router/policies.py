"""Routing policies: which of the available workers of a pool gets a request.

round-robin         each worker in turn (its place in the flag's list), skipping those not
                    healthy.
least-outstanding   the fewest requests in flight through this router; ties in turn.
prefix-aware        vllm-router's / sglang-router's ``cache_aware`` on the workers' real KV
                    cache (their KV events, ``prefix_index``), not an approximate tree:

    1. the load is *imbalanced* when max - min outstanding > ``balance_abs_threshold`` and
       max > ``balance_rel_threshold`` * min: least-outstanding, the cache ignored;
    2. else the prompt is tokenized and hashed into blocks as the engine does, and each
       worker's match is the run of leading blocks it holds; the best match (ties: fewer
       outstanding) gets the request if it covers more than ``cache_threshold`` of the
       prompt's tokens;
    3. else least-outstanding (ties: the fewest cached blocks, sglang's "smallest tree").

    The chosen worker's blocks count as cached for ``speculative_ttl`` seconds (until its
    events say so). The prompt is not tokenized while no worker holds anything and
    speculation is off, nor when the load is imbalanced.

A policy sees only available workers, at least one.

``Pinned`` sends a request to the one worker that holds its state (a Responses turn's
``previous_response_id``), or by its fallback policy when that worker is not available.
"""
from __future__ import annotations

from typing import Sequence

from sloserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from sloserve.router.prompt import PromptTokenizer
from sloserve.router.workers import Worker


class RouteContext:
    """The request being routed, as a policy may ask about it (its token ids are computed once,
    on demand)."""

    def __init__(self, body: dict, chat: bool, tokenizer: PromptTokenizer | None = None):
        self.body = body
        self.chat = chat
        self.tokenizer = tokenizer
        self._tokens: list[int] | None = None
        self._asked = False

    @property
    def salt(self) -> str | None:
        s = self.body.get("cache_salt")
        return s if isinstance(s, str) and s else None

    async def token_ids(self, worker_url: str | None) -> list[int] | None:
        if not self._asked and self.tokenizer is not None:
            self._asked = True
            self._tokens = await self.tokenizer.token_ids(self.body, self.chat, worker_url)
        return self._tokens


class _Turns:
    """A pointer into a pool's list: the next worker in turn at or after it."""

    def __init__(self):
        self._next = 0

    def pick(self, workers: Sequence[Worker]) -> Worker:
        after = [w for w in workers if w.index >= self._next]
        w = min(after or workers, key=lambda w: w.index)
        self._next = w.index + 1
        return w


class RoundRobin:
    name = "round-robin"

    def __init__(self, metrics=None):
        self._turns = _Turns()
        self.metrics = metrics

    async def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        if self.metrics is not None:
            self.metrics.decision(self.name, "turn")
        return self._turns.pick(workers)


class LeastOutstanding:
    name = "least-outstanding"

    def __init__(self, metrics=None):
        self._turns = _Turns()
        self.metrics = metrics

    def least(self, workers: Sequence[Worker], key=None) -> Worker:
        """The fewest outstanding (then the smallest ``key``), ties in turn."""
        def k(w):
            return (w.outstanding, key(w)) if key is not None else w.outstanding
        best = min(k(w) for w in workers)
        return self._turns.pick([w for w in workers if k(w) == best])

    async def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        if self.metrics is not None:
            self.metrics.decision(self.name, "least")
        return self.least(workers)


class Pinned:
    """``worker`` if it is available, else ``fallback``'s choice."""

    name = "pinned"

    def __init__(self, worker: Worker, fallback, metrics=None):
        self.worker, self.fallback, self.metrics = worker, fallback, metrics

    async def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        if self.worker in workers:
            if self.metrics is not None:
                self.metrics.decision(self.name, "holder")
            return self.worker
        return await self.fallback.choose(workers, ctx)


class PrefixAware:
    """See the module docstring.

    Args:
        index: the workers' cached blocks.
        cache_threshold, balance_abs_threshold, balance_rel_threshold: see the module
            docstring (``--cache-threshold`` etc.).
        block_size: hashes prompts for a worker whose events have not named its block size.
    """

    name = "prefix-aware"

    def __init__(self, index: PrefixIndex, cache_threshold: float, balance_abs_threshold: int,
                 balance_rel_threshold: float, block_size: int, metrics=None):
        self.index = index
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_size = block_size
        self.metrics = metrics
        self._least = LeastOutstanding()

    def imbalanced(self, workers: Sequence[Worker]) -> bool:
        loads = [w.outstanding for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def _decide(self, decision: str) -> None:
        if self.metrics is not None:
            self.metrics.decision(self.name, decision)

    async def choose(self, workers: Sequence[Worker], ctx: RouteContext) -> Worker:
        if len(workers) == 1:
            self._decide("single")
            return workers[0]
        if self.imbalanced(workers):
            self._decide("imbalanced")
            return self._least.least(workers)
        fallback = self._least.least(workers, key=lambda w: self.index.num_blocks(w.url))
        if self.index.speculative_ttl <= 0 and not self.index.holds_any(w.url for w in workers):
            self._decide("no_cache")
            return fallback
        tokens = await ctx.token_ids(fallback.url)
        if not tokens:
            self._decide("no_prompt")
            return fallback
        by_size: dict[int, list[int]] = {}

        def hashes(w: Worker) -> tuple[int, list[int]]:
            bs = self.index.block_size(w.url, self.block_size)
            if bs not in by_size:
                by_size[bs] = prompt_block_hashes(tokens, bs, ctx.salt)
            return bs, by_size[bs]

        best, best_hit = None, -1
        for w in workers:  # in index order: ties go to the fewer outstanding, then the first
            bs, hs = hashes(w)
            hit = self.index.match(w.url, hs) * bs
            if hit > best_hit or (hit == best_hit and w.outstanding < best.outstanding):
                best, best_hit = w, hit
        if best_hit > 0 and best_hit / len(tokens) > self.cache_threshold:
            chosen, hit = best, best_hit
            self._decide("prefix_match")
        else:
            chosen = fallback
            bs, hs = hashes(chosen)
            hit = self.index.match(chosen.url, hs) * bs
            self._decide("below_threshold")
        if self.metrics is not None:
            self.metrics.prefix_lookup(len(tokens), hit)
        self.index.add_pending(chosen.url, hashes(chosen)[1])
        return chosen


def make_policy(name: str, index: PrefixIndex | None, config, metrics=None):
    """The policy ``name`` (``RouterConfig`` holds the thresholds)."""
    if name == "round-robin":
        return RoundRobin(metrics)
    if name == "least-outstanding":
        return LeastOutstanding(metrics)
    if name == "prefix-aware":
        assert index is not None
        return PrefixAware(index, config.cache_threshold, config.balance_abs_threshold,
                           config.balance_rel_threshold, config.block_size, metrics)
    raise ValueError(f"unknown routing policy {name!r}")
