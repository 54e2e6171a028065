"""Each routing policy's choice, on workers with given loads and cached blocks (no HTTP)."""
from __future__ import annotations

import asyncio

from sloserve.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from sloserve.router.policies import (LeastOutstanding, PrefixAware, RoundRobin,
                                      RouteContext)
from sloserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from sloserve.router.workers import Worker


def _workers(*loads: int) -> list[Worker]:
    ws = [Worker(f"http://w{i}", "replica", i) for i in range(len(loads))]
    for w, n in zip(ws, loads):
        w.inflight.update(object() for _ in range(n))
    return ws


class _Tokens:
    """A tokenizer stub: the prompt's characters."""

    def __init__(self):
        self.calls = 0

    async def token_ids(self, body, chat, worker_url):
        self.calls += 1
        return [ord(c) for c in body["prompt"]]


def _choose(policy, workers, body=None, tokenizer=None) -> str:
    ctx = RouteContext(body or {"prompt": "x"}, False, tokenizer)
    return asyncio.run(policy.choose(workers, ctx)).url


def _store(index: PrefixIndex, url: str, text: str, block_size: int = 4, salt=None) -> None:
    hashes = prompt_block_hashes([ord(c) for c in text], block_size, salt)
    index.apply(url, KVEventBatch(0.0, [BlockStored(hashes, None, [], block_size)]))


def test_round_robin_takes_turns_over_the_available():
    ws = _workers(0, 0, 0)
    rr = RoundRobin()
    assert [_choose(rr, ws) for _ in range(4)] == ["http://w0", "http://w1", "http://w2",
                                                   "http://w0"]
    assert [_choose(rr, [ws[0], ws[2]]) for _ in range(3)] == ["http://w2", "http://w0",
                                                               "http://w2"]


def test_least_outstanding_and_its_ties():
    ws = _workers(3, 1, 1)
    lo = LeastOutstanding()
    assert [_choose(lo, ws) for _ in range(3)] == ["http://w1", "http://w2", "http://w1"]
    assert _choose(lo, _workers(0, 2)) == "http://w0"


def _prefix_aware(index, **kw) -> PrefixAware:
    args = dict(cache_threshold=0.3, balance_abs_threshold=64, balance_rel_threshold=1.5,
                block_size=4)
    args.update(kw)
    return PrefixAware(index, **args)


def test_prefix_aware_follows_the_cached_prefix():
    index = PrefixIndex()
    ws = _workers(5, 0, 0)
    prompt = "abcdefghijklmnopqrstuvwx"  # 6 blocks of 4
    _store(index, "http://w0", prompt[:16])  # 4 of 6 blocks: 0.67 > 0.3
    _store(index, "http://w1", prompt[:4])
    tok = _Tokens()
    pa = _prefix_aware(index)
    assert _choose(pa, ws, {"prompt": prompt}, tok) == "http://w0"  # busier, but cached
    # below the threshold (1 of 6 blocks = 0.17): least-outstanding, the fewest cached blocks
    assert _choose(pa, ws, {"prompt": prompt[:4] + "zzzzzzzzzzzzzzzzzzzz"}, tok) == "http://w2"
    # the salt names other blocks: no match anywhere
    assert _choose(pa, ws, {"prompt": prompt, "cache_salt": "s"}, tok) == "http://w2"
    _store(index, "http://w0", prompt, salt="s")
    assert _choose(pa, ws, {"prompt": prompt, "cache_salt": "s"}, tok) == "http://w0"
    # a lower threshold takes the one-block match
    pa = _prefix_aware(index, cache_threshold=0.1)
    assert _choose(pa, ws, {"prompt": prompt[:4] + "zzzzzzzzzzzzzzzzzzzz"}, tok) == "http://w1"


def test_prefix_aware_balances_when_the_load_is_imbalanced():
    index = PrefixIndex()
    prompt = "abcdefghijklmnop"
    _store(index, "http://w0", prompt)
    tok = _Tokens()
    pa = _prefix_aware(index, balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert _choose(pa, _workers(4, 0), {"prompt": prompt}, tok) == "http://w0"  # diff 4: not > 4
    calls = tok.calls
    assert _choose(pa, _workers(5, 0), {"prompt": prompt}, tok) == "http://w1"  # imbalanced
    assert tok.calls == calls  # not even tokenized
    assert _choose(pa, _workers(12, 9), {"prompt": prompt}, tok) == "http://w0"  # 12 < 1.5 * 9


def test_prefix_aware_tracks_removals_clears_and_pending_blocks():
    now = [0.0]
    index = PrefixIndex(speculative_ttl=2.0, clock=lambda: now[0])
    prompt = "abcdefghijklmnop"
    hashes = prompt_block_hashes([ord(c) for c in prompt], 4)
    _store(index, "http://w1", prompt)
    assert index.match("http://w1", hashes) == 4
    index.apply("http://w1", KVEventBatch(0.0, [BlockRemoved([hashes[1]])]))
    assert index.match("http://w1", hashes) == 1  # the engine reuses up to the first miss
    index.apply("http://w1", KVEventBatch(0.0, [AllBlocksCleared()]))
    assert index.match("http://w1", hashes) == 0
    # a new prefix: routed least-outstanding, then its blocks count as cached there for 2 s
    ws = _workers(0, 0)
    pa = _prefix_aware(index)
    tok = _Tokens()
    first = _choose(pa, ws, {"prompt": prompt}, tok)
    ws[0 if first == "http://w0" else 1].inflight.add(object())  # the first is busier now
    assert _choose(pa, ws, {"prompt": prompt}, tok) == first
    now[0] = 2.5
    assert _choose(pa, ws, {"prompt": prompt}, tok) != first


def test_prefix_aware_needs_no_tokens_while_nothing_is_cached():
    pa = _prefix_aware(PrefixIndex(speculative_ttl=0.0))
    tok = _Tokens()
    assert _choose(pa, _workers(1, 0), {"prompt": "abcdefgh"}, tok) == "http://w1"
    assert tok.calls == 0
