"""Block pool: the fixed set of KV cache blocks, an LRU free queue, reference counts, and the
prefix cache's map from block hash to block.

Plain Python, no torch: it hands out block ids; the model runner owns the tensors they index.
(vLLM/PagedAttention, Kwon et al. 2023, section 4.2; the cache is vLLM V1's automatic prefix
caching.)

A block is *free* when no request references it (ref count 0). A free block may still hold a
cached full block (it keeps its hash): it sits in the free queue in the order it was freed and is
evicted only when ``allocate`` takes it for new tokens, oldest first. A hit on a free cached block
takes it out of the queue again (``touch``).

KV cache events (``enable_kv_events``; vLLM's ``--kv-events-config``): the pool can record what
its prefix cache gains and loses, for ``sloserve.engine.kv_events`` to publish. Records are plain
tuples (turned into vLLM's event structs off the step loop, by the publisher):

    ("BlockStored", block_hash, parent_hash | None, token_ids | None, block_size)
                                a held block got its hash (``cache_block``)
    ("BlockRemoved", block_hash)    a cached block's hash was evicted (``allocate`` reused it)
    ("AllBlocksCleared",)           every cached hash was forgotten (``reset_cache``)

Off (the default), recording costs one ``is None`` test where a block is cached or evicted.
"""
from __future__ import annotations

from collections import OrderedDict

from sloserve.engine.block_hash import BlockHash


class BlockPoolError(RuntimeError):
    """A block was freed twice or an unknown block id was used (an engine bug, never user input)."""


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        #: free blocks, least recently freed first (OrderedDict: O(1) removal on a cache hit)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        #: KV cache event records since the last ``take_events`` (None: not recording)
        self._events: list[tuple] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are reclaimable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    # ------------------------------------------------------------------ KV cache events
    def enable_kv_events(self) -> None:
        """Record KV cache events from now on (see the module docstring)."""
        if self._events is None:
            self._events = []

    @property
    def kv_events_enabled(self) -> bool:
        return self._events is not None

    def take_events(self) -> list[tuple]:
        """The event records since the last call, oldest first (empty when not recording)."""
        ev = self._events
        if not ev:
            return []
        self._events = []
        return ev

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def _check(self, block_ids) -> None:
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"unknown block id {b}")

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks (ref count 1 each), evicting the cached content of the least
        recently freed; None, taking nothing, if fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                self._hash[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
                    if self._events is not None:
                        self._events.append(("BlockRemoved", h))
                self.num_evictions += 1
            self._ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference to each block, free (cached) or held.

        Raises:
            BlockPoolError: an unknown block id, or a free block with no cached content (nothing
                is changed then).
        """
        self._check(block_ids)
        for b in block_ids:
            if self._ref_cnt[b] == 0 and self._hash[b] is None:
                raise BlockPoolError(f"touch of free, uncached block {b}")
        for b in block_ids:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to each held block.

        Raises:
            BlockPoolError: an unknown or free block id (nothing is changed then).
        """
        self._check(block_ids)
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise BlockPoolError(f"incref of free block {b}")
        for b in block_ids:
            self._ref_cnt[b] += 1

    def free(self, block_ids) -> None:
        """Drop one reference from each block, in order; a block joins the free queue's tail at
        zero (so the blocks given first are evicted first).

        Raises:
            BlockPoolError: a block is already free (double free).
        """
        block_ids = list(block_ids)
        self._check(block_ids)
        for b in block_ids:
            if self._ref_cnt[b] <= 0:
                raise BlockPoolError(f"double free of block {b}")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None

    # ------------------------------------------------------------------ prefix cache
    def cache_block(self, block_id: int, block_hash: BlockHash, *,
                    parent_hash: BlockHash | None = None, token_ids=None) -> None:
        """Record that held block `block_id` holds the full block named `block_hash` (a second
        block with the same content stays uncached: the first one serves hits).

        ``parent_hash`` (the previous block's hash) and ``token_ids`` (the block's tokens) only
        go into the ``BlockStored`` event when events are recorded; without them the event has
        no parent and no tokens."""
        if self._ref_cnt[block_id] <= 0:
            raise BlockPoolError(f"caching free block {block_id}")
        if self._hash[block_id] is not None or block_hash in self._cached:
            return
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self._events is not None:
            self._events.append(("BlockStored", block_hash, parent_hash,
                                 None if token_ids is None else list(token_ids),
                                 self.block_size))

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding `block_hash`, or None."""
        return self._cached.get(block_hash)

    def reset_cache(self) -> int:
        """Forget every cached block (held blocks keep their tokens, but serve no more hits);
        returns how many were forgotten."""
        n = len(self._cached)
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        if self._events is not None:
            self._events.append(("AllBlocksCleared",))
        return n
