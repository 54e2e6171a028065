"""Block pool: the fixed set of KV cache blocks, a free list and reference counts.

Plain Python, no torch: it hands out block ids; the model runner owns the tensors they index.
(vLLM/PagedAttention, Kwon et al. 2023, section 4.2.)
"""
from __future__ import annotations

from collections import deque


class BlockPoolError(RuntimeError):
    """A block was freed twice or an unknown block id was used (an engine bug, never user input)."""


class BlockPool:
    """`num_blocks` KV blocks of `block_size` tokens each.

    Reference counts let a future prefix cache share a block between requests; today every
    allocated block has ref count 1.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks (ref count 1 each); None, taking nothing, if fewer are free."""
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref_cnt[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        """Add one reference to each (allocated) block.

        Raises:
            BlockPoolError: an unknown or free block id (nothing is changed then).
        """
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"unknown block id {b}")
            if self._ref_cnt[b] <= 0:
                raise BlockPoolError(f"incref of free block {b}")
        for b in block_ids:
            self._ref_cnt[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block returns to the free list at zero.

        Raises:
            BlockPoolError: a block is already free (double free).
        """
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"unknown block id {b}")
            if self._ref_cnt[b] <= 0:
                raise BlockPoolError(f"double free of block {b}")
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)
