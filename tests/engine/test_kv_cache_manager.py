"""KVCacheManager: block tables over the pool, ceil(tokens / block_size) blocks per request."""
from __future__ import annotations

import pytest

from sloserve.engine.block_pool import BlockPoolError
from sloserve.engine.kv_cache_manager import KVCacheManager, cdiv


@pytest.mark.parametrize("a,b,expected", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2),
                                          (16, 16, 1), (17, 16, 2), (7, 1, 7)])
def test_cdiv(a, b, expected):
    assert cdiv(a, b) == expected


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_table_length_is_ceil_tokens_over_block_size(block_size):
    kv = KVCacheManager(200, block_size)
    for n in range(1, 60):
        assert kv.allocate_slots("r", n)
        table = kv.get_block_table("r")
        assert len(table) == cdiv(n, block_size)
        # at most one partly filled block: the capacity of all but the last block is < n
        assert (len(table) - 1) * block_size < n <= len(table) * block_size
    assert kv.num_free_blocks == 200 - cdiv(59, block_size)


def test_growing_a_table_keeps_existing_blocks_in_order():
    kv = KVCacheManager(16, 4)
    assert kv.allocate_slots("r", 5)
    first = list(kv.get_block_table("r"))
    assert kv.allocate_slots("r", 13)
    table = kv.get_block_table("r")
    assert table[:2] == first
    assert len(table) == 4 and len(set(table)) == 4


def test_num_blocks_needed():
    kv = KVCacheManager(16, 4)
    assert kv.num_blocks_needed("r", 1) == 1
    assert kv.num_blocks_needed("r", 9) == 3
    kv.allocate_slots("r", 6)                  # 2 blocks
    assert kv.num_blocks_needed("r", 8) == 0
    assert kv.num_blocks_needed("r", 9) == 1
    assert kv.num_blocks_needed("r", 3) == 0  # never negative


def test_allocate_fails_atomically_and_keeps_existing_table():
    kv = KVCacheManager(4, 4)
    assert kv.allocate_slots("a", 8)           # 2 blocks
    assert kv.allocate_slots("b", 4)           # 1 block, 1 free
    before = list(kv.get_block_table("a"))
    assert not kv.allocate_slots("a", 16)      # needs 2 more, only 1 free
    assert kv.get_block_table("a") == before
    assert kv.num_free_blocks == 1
    assert not kv.allocate_slots("c", 8)       # new request that does not fit: no entry left
    assert "c" not in kv.block_tables
    assert kv.get_block_table("c") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots("c", 4)
    assert kv.num_free_blocks == 0


def test_free_returns_all_blocks_and_is_idempotent():
    kv = KVCacheManager(10, 4)
    kv.allocate_slots("a", 10)
    kv.allocate_slots("b", 7)
    assert kv.num_free_blocks == 10 - 3 - 2
    assert kv.usage == pytest.approx(0.5)
    kv.free("a")
    assert kv.num_free_blocks == 8
    assert kv.get_block_table("a") == []
    kv.free("a")                               # no-op: it holds nothing any more
    kv.free("never-seen")
    assert kv.num_free_blocks == 8
    kv.free("b")
    assert kv.num_free_blocks == 10
    assert kv.usage == 0.0


def test_tables_are_disjoint():
    kv = KVCacheManager(12, 2)
    for i, n in enumerate([3, 5, 1, 7]):
        assert kv.allocate_slots(f"r{i}", n)
    held = [b for t in kv.block_tables.values() for b in t]
    assert len(held) == len(set(held)) == 2 + 3 + 1 + 4
    assert kv.num_free_blocks == 12 - len(held)


def test_freeing_a_table_twice_through_the_pool_raises():
    kv = KVCacheManager(4, 4)
    kv.allocate_slots("a", 8)
    table = list(kv.get_block_table("a"))
    kv.free("a")
    with pytest.raises(BlockPoolError):
        kv.pool.free(table)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_arithmetic(block_size):
    """Token at position p lives at slot table[p // bs] * bs + p % bs: the slots of one request
    are distinct, and slots of different requests never collide."""
    from sloserve.model.runner import build_step_inputs
    from sloserve.sampling_params import SamplingParams
    from sloserve.step_io import ScheduledRequest, SchedulerOutput

    kv = KVCacheManager(64, block_size)
    lengths = {"a": 37, "b": 5, "c": 2 * block_size}
    for rid, n in lengths.items():
        assert kv.allocate_slots(rid, n)
    all_slots = []
    for rid, n in lengths.items():
        table = kv.get_block_table(rid)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        # the model runner uses the same formula
        for start in (0, min(3, n - 1)):
            sr = ScheduledRequest(rid, start, n - start, [1] * (n - start), table,
                                  SamplingParams(), samples=True, is_decode=False)
            inputs = build_step_inputs(SchedulerOutput([sr]), block_size)
            assert inputs.slot_mapping.tolist() == slots[start:]
        for p, s in enumerate(slots):
            assert s // block_size == table[p // block_size]
            assert s % block_size == p % block_size
        all_slots += slots
    assert len(all_slots) == len(set(all_slots))
    assert max(all_slots) < 64 * block_size
