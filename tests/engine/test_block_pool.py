"""BlockPool: free list, reference counts, double-free detection."""
from __future__ import annotations

import pytest

from sloserve.engine.block_pool import BlockPool, BlockPoolError


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


def test_fresh_pool_is_all_free():
    pool = BlockPool(8, 16)
    assert pool.num_blocks == 8
    assert pool.block_size == 16
    assert pool.num_free_blocks == 8
    assert pool.usage == 0.0


def test_allocate_takes_distinct_blocks_and_accounts():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert sorted(a + b) == list(range(8))
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0
    pool.free(a)
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(5 / 8)


def test_allocate_zero_returns_empty_list():
    pool = BlockPool(2, 4)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_fails_atomically_when_short():
    pool = BlockPool(4, 4)
    held = pool.allocate(3)
    assert pool.allocate(2) is None          # only one free: takes nothing
    assert pool.num_free_blocks == 1
    last = pool.allocate(1)
    assert last is not None and len(last) == 1
    assert set(last).isdisjoint(held)
    assert pool.allocate(1) is None
    assert pool.num_free_blocks == 0


def test_freed_blocks_are_reused():
    pool = BlockPool(2, 4)
    a = pool.allocate(2)
    pool.free(a)
    b = pool.allocate(2)
    assert sorted(b) == sorted(a)


def test_double_free_raises():
    pool = BlockPool(4, 4)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([a[0]])
    assert pool.num_free_blocks == 4  # the failed free changed nothing


def test_free_of_never_allocated_block_raises():
    pool = BlockPool(4, 4)
    with pytest.raises(BlockPoolError):
        pool.free([0])


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_free_of_unknown_block_raises(bad):
    pool = BlockPool(4, 4)
    pool.allocate(4)
    with pytest.raises(BlockPoolError, match="unknown block"):
        pool.free([bad])
    assert pool.num_free_blocks == 0


def test_refcount_keeps_shared_block_until_last_free():
    pool = BlockPool(2, 4)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.num_free_blocks == 1          # still referenced once
    pool.free([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(BlockPoolError):
        pool.free([b])


def test_incref_of_free_block_raises():
    pool = BlockPool(2, 4)
    with pytest.raises(BlockPoolError):
        pool.incref([0])


@pytest.mark.parametrize("bad", [-1, 2])
def test_incref_of_unknown_block_raises_blockpoolerror(bad):
    """BlockPoolError documents "an unknown block id was used"; incref must check the range like
    free does (a negative id must not silently bump the last block's count)."""
    pool = BlockPool(2, 4)
    pool.allocate(2)
    with pytest.raises(BlockPoolError):
        pool.incref([bad])
    # nothing was changed: each block still goes back to the free list on one free
    pool.free([0, 1])
    assert pool.num_free_blocks == 2
