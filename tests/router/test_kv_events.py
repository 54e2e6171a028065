"""KV cache events: what the block pool records, their vLLM encoding, the publisher through a
real ZeroMQ PUB/SUB (and its replay socket), and the hashes matching the router's."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from sloserve.engine.block_hash import extend_block_hashes
from sloserve.engine.block_pool import BlockPool
from sloserve.engine.kv_cache_manager import KVCacheManager
from sloserve.engine.kv_events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored,
                                       KVEventBatch, KVEventPublisher, KVEventsConfig,
                                       decode_event_batch, encode_event_batch,
                                       events_from_records, external_block_hash)
from sloserve.engine.request import Request
from sloserve.router.prefix_index import PrefixIndex, prompt_block_hashes
from sloserve.sampling_params import SamplingParams


def _hashes(n: int) -> list[bytes]:
    return extend_block_hashes([], list(range(4 * n)), 4)


def test_block_pool_records_nothing_unless_enabled():
    pool = BlockPool(4, 4)
    h = _hashes(2)
    b = pool.allocate(2)
    pool.cache_block(b[0], h[0])
    pool.reset_cache()
    assert not pool.kv_events_enabled and pool.take_events() == []
    assert pool._events is None


def test_block_pool_records_stores_evictions_and_resets():
    pool = BlockPool(2, 4)
    pool.enable_kv_events()
    h = _hashes(3)
    b = pool.allocate(2)
    pool.cache_block(b[0], h[0], token_ids=[0, 1, 2, 3])
    pool.cache_block(b[1], h[1], parent_hash=h[0], token_ids=[4, 5, 6, 7])
    pool.cache_block(b[1], h[1])  # already cached: nothing
    assert pool.take_events() == [("BlockStored", h[0], None, [0, 1, 2, 3], 4),
                                  ("BlockStored", h[1], h[0], [4, 5, 6, 7], 4)]
    assert pool.take_events() == []
    pool.free([b[1], b[0]])
    pool.allocate(1)  # evicts the first freed: b[1]
    assert pool.take_events() == [("BlockRemoved", h[1])]
    pool.reset_cache()
    assert pool.take_events() == [("AllBlocksCleared",)]


def test_records_become_merged_vllm_events():
    h = _hashes(4)
    x = external_block_hash
    events = events_from_records([
        ("BlockStored", h[0], None, [1] * 4, 4), ("BlockStored", h[1], h[0], [2] * 4, 4),
        ("BlockStored", h[2], None, None, 4),  # no parent given: a new event
        ("BlockRemoved", h[0]), ("BlockRemoved", h[1]), ("AllBlocksCleared",),
        ("BlockStored", h[3], h[2], None, 4)])
    assert events == [BlockStored([x(h[0]), x(h[1])], None, [1] * 4 + [2] * 4, 4),
                      BlockStored([x(h[2])], None, [], 4),
                      BlockRemoved([x(h[0]), x(h[1])]), AllBlocksCleared(),
                      BlockStored([x(h[3])], x(h[2]), [], 4)]
    assert x(h[0]) == int.from_bytes(h[0][-8:], "big") < 2 ** 64


def test_batch_encoding_is_vllms_and_reads_the_older_array_form():
    batch = KVEventBatch(12.5, [BlockStored([1, 2], 7, list(range(8)), 4),
                                BlockRemoved([1]), AllBlocksCleared()])
    raw = msgspec.msgpack.decode(encode_event_batch(batch))
    assert raw == {"ts": 12.5, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": None},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": None},
        {"type": "AllBlocksCleared"}]}
    assert decode_event_batch(encode_event_batch(batch)) == batch
    old = msgspec.msgpack.encode([3.0, [["BlockStored", [b"\x01" * 32], None, [], 16, None,
                                        "GPU"], ["BlockRemoved", [5], "GPU"],
                                       ["AllBlocksCleared"], ["SomethingNew", 1]], 0])
    got = decode_event_batch(old)
    assert got.ts == 3.0 and got.data_parallel_rank == 0
    assert got.events == [BlockStored([b"\x01" * 32], None, [], 16, None, "GPU"),
                          BlockRemoved([5], "GPU"), AllBlocksCleared()]
    with pytest.raises(ValueError):
        decode_event_batch(b"\xc1")


def test_config_takes_vllms_keys():
    c = KVEventsConfig.of('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", '
                          '"topic": "kv", "replay_endpoint": "tcp://*:6001"}')
    assert c.enabled and c.publisher == "zmq" and c.buffer_steps == 10_000
    assert not KVEventsConfig.of({}).enabled
    for bad in ('{"enable_kv_cache_events": "yes"}', '{"endpoints": "x"}', "[1]", "{",
                '{"publisher": "kafka"}'):
        with pytest.raises(ValueError):
            KVEventsConfig.of(bad)
    with pytest.raises(ValueError):
        KVEventPublisher({"enable_kv_cache_events": False})


def test_publisher_round_trips_through_pub_sub_and_replays(tmp_path):
    ep, replay_ep = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    pub = KVEventPublisher({"enable_kv_cache_events": True, "endpoint": ep,
                            "replay_endpoint": replay_ep, "topic": "kv@a"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@a")
    sub.connect(ep)
    h = _hashes(2)
    try:
        # a subscriber hears only what is sent after its subscription reached the publisher
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline
            pub.publish([("AllBlocksCleared",)])
        received = [sub.recv_multipart()]
        pub.publish([("BlockStored", h[0], None, [0, 1, 2, 3], 4),
                     ("BlockStored", h[1], h[0], [4, 5, 6, 7], 4)])
        pub.publish([BlockRemoved([external_block_hash(h[1])])])
        while len(received) < 3:
            assert sub.poll(5000)
            received.append(sub.recv_multipart())
        topics = {m[0] for m in received}
        seqs = [int.from_bytes(m[1], "big") for m in received]
        assert topics == {b"kv@a"} and seqs == list(range(seqs[0], seqs[0] + 3))
        stored, removed = decode_event_batch(received[1][2]), decode_event_batch(received[2][2])
        assert abs(stored.ts - time.time()) < 60
        assert stored.events == [BlockStored([external_block_hash(x) for x in h], None,
                                             list(range(8)), 4)]
        assert removed.events == [BlockRemoved([external_block_hash(h[1])])]
        # replay (vLLM's ROUTER protocol) from the stored batch on
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", seqs[1].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(seqs[1], received[1][2]), (seqs[2], received[2][2])]
        dealer.close(0)
    finally:
        sub.close(0)
        ctx.term()
        pub.close()
    with pytest.raises(RuntimeError):
        pub.publish([("AllBlocksCleared",)])


def test_engine_hashes_are_the_routers():
    """A request's blocks cached by the engine's KV cache manager (with the cache salt), as
    events, give the router's index a full match on that prompt's hashes, and no match on
    another salt's."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    kv.pool.enable_kv_events()
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    req = Request("r1", prompt, SamplingParams(max_tokens=4), cache_salt="tenant-1")
    assert kv.allocate_slots("r1", len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.cache_blocks(req)
    events = events_from_records(kv.pool.take_events())
    index = PrefixIndex()
    index.apply("w", KVEventBatch(0.0, events))
    assert index.num_blocks("w") == 4 and index.block_size("w", 16) == 4
    assert index.match("w", prompt_block_hashes(prompt, 4, "tenant-1")) == 4
    assert index.match("w", prompt_block_hashes(prompt + [1, 2], 4, "tenant-1")) == 4
    assert index.match("w", prompt_block_hashes(prompt, 4, None)) == 0
    assert index.match("w", prompt_block_hashes([7] + prompt, 4, "tenant-1")) == 0


def test_a_taken_endpoint_is_a_bad_setting(tmp_path):
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}
    first = KVEventPublisher(cfg)
    try:
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ValueError, match="cannot open"):
            KVEventPublisher({**cfg, "endpoint": f"tcp://*:{port}"})
    finally:
        first.close()
