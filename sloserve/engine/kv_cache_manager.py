"""KV cache manager: per-request block tables over the block pool."""
from __future__ import annotations

from sloserve.engine.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Keeps each request's block table: the ordered block ids holding its tokens' K and V.

    Token at position p of a request lives in block `block_table[p // block_size]` at offset
    `p % block_size`; its slot (row in the flattened cache) is `block * block_size + offset`.
    A request holds exactly ceil(num_tokens_in_cache / block_size) blocks, so it wastes at most
    one partly filled block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.block_tables: dict[str, list[int]] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the block table so positions [0, num_tokens) have slots.

        Returns False, allocating nothing, if the pool has too few free blocks.
        """
        need = self.num_blocks_needed(request_id, num_tokens)
        table = self.block_tables.setdefault(request_id, [])
        if need == 0:
            return True
        new = self.pool.allocate(need)
        if new is None:
            if not table:
                del self.block_tables[request_id]
            return False
        table.extend(new)
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
            self.pool.free(table[keep:])
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool (no-op if it holds none)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
