"""KV cache manager: per-request block tables over the block pool, and automatic prefix caching.

With prefix caching on (vLLM V1's design, see ``block_pool`` and ``block_hash``), a request's
full blocks are registered under their chained hash once their tokens are computed; a new (or
preempted) request starts from the longest run of cached blocks that match its tokens (shared by
reference count), always leaving its last token to compute so that the step yields logits.
"""
from __future__ import annotations

from sloserve.engine.block_hash import extend_block_hashes
from sloserve.engine.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Keeps each request's block table: the ordered block ids holding its tokens' K and V.

    Token at position p of a request lives in block `block_table[p // block_size]` at offset
    `p % block_size`; its slot (row in the flattened cache) is `block * block_size + offset`.
    A request holds exactly ceil(num_tokens_in_cache / block_size) blocks, so it wastes at most
    one partly filled block.

    Attributes:
        enable_prefix_caching: see the module docstring.
        prefix_cache_queries, prefix_cache_hits: tokens looked up / found in the cache, counted
            when a request is admitted (vLLM's ``prefix_cache_queries`` / ``_hits``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # request id -> its blocks registered so far
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks `request_id` needs so that `num_tokens` tokens fit."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request) -> tuple[list[int], int]:
        """The cached blocks a request holding no blocks can start from, and their token count
        (a multiple of block_size, at most num_tokens - 1). ([], 0) with caching off.

        ``request`` is an ``engine.request.Request`` (its ``block_hashes`` are filled in here).
        """
        if not self.enable_prefix_caching or request.request_id in self.block_tables:
            return [], 0
        tokens = request.all_token_ids
        hashes = extend_block_hashes(request.block_hashes, tokens, self.block_size,
                                     request.cache_salt)
        limit = (len(tokens) - 1) // self.block_size
        blocks = []
        for h in hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def cache_blocks(self, request) -> None:
        """Register the request's full blocks whose tokens are all computed (no-op when off)."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        n_full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_registered.get(request.request_id, 0)
        if n_full <= done:
            return
        hashes = extend_block_hashes(request.block_hashes,
                                     request.token_ids_range(0, n_full * self.block_size),
                                     self.block_size, request.cache_salt)
        events = self.pool.kv_events_enabled
        bs = self.block_size
        for i in range(done, n_full):
            if events:  # the BlockStored event names its parent and its tokens
                self.pool.cache_block(table[i], hashes[i],
                                      parent_hash=hashes[i - 1] if i else None,
                                      token_ids=request.token_ids_range(i * bs, (i + 1) * bs))
            else:
                self.pool.cache_block(table[i], hashes[i])
        self._num_registered[request.request_id] = n_full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (``POST /reset_prefix_cache``); returns how many."""
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ block tables
    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Grow the block table so positions [0, num_tokens) have slots, starting a request that
        holds no blocks from ``computed_blocks`` (prefix-cache hits, shared) if given.

        Returns False, changing nothing, if the pool has too few free blocks.
        """
        table = self.block_tables.get(request_id)
        if computed_blocks:
            assert table is None, "cached blocks only start a request"
            self.pool.touch(computed_blocks)
            table = list(computed_blocks)
        elif table is None:
            table = []
        need = max(0, cdiv(num_tokens, self.block_size) - len(table))
        new = self.pool.allocate(need) if need else []
        if new is None:
            if computed_blocks:
                self.pool.free(reversed(computed_blocks))
            return False
        table.extend(new)
        if request_id not in self.block_tables:
            self.block_tables[request_id] = table
            if computed_blocks:
                self._num_registered[request_id] = len(computed_blocks)
        return True

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Return the blocks past what positions [0, num_tokens) need (after rejected draft
        tokens were rolled back); the slots of rejected tokens in kept blocks are overwritten
        when those positions are computed again."""
        table = self.block_tables.get(request_id)
        if table is None:
            return
        keep = cdiv(num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
            if self._num_registered.get(request_id, 0) > keep:
                self._num_registered[request_id] = keep

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool, last block first (so a cached
        sequence's tail is evicted before its head); no-op if it holds none."""
        table = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
