"""Automatic prefix caching: block hashes, the pool's LRU of cached free blocks, the scheduler's
hits, a random-workload property test, and greedy outputs identical with the cache cold, warm and
off on a real (tiny, float32) model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sloserve.engine.block_hash import extend_block_hashes, hash_block
from sloserve.engine.block_pool import BlockPool, BlockPoolError
from sloserve.engine.kv_cache_manager import KVCacheManager, cdiv
from sloserve.engine.request import Request, RequestStatus
from sloserve.engine.scheduler import Scheduler, SchedulerConfig
from sloserve.sampling_params import SamplingParams

from .conftest import check_kv_invariants, drive_step, expected_outputs

BS = 4


# ----------------------------------------------------------------------------- hashes
def test_block_hash_is_the_same_in_another_process():
    here = hash_block(None, [1, 2, 3, 4], "salt").hex() + hash_block(b"p" * 32, [5, 6, 7, 8]).hex()
    code = ("from sloserve.engine.block_hash import hash_block;"
            "print(hash_block(None, [1, 2, 3, 4], 'salt').hex() + "
            "hash_block(b'p' * 32, [5, 6, 7, 8]).hex())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, check=True).stdout.strip()
    assert here == there


def test_block_hash_chains_and_separates_salts():
    a = extend_block_hashes([], list(range(10)), BS)
    assert len(a) == 2  # two full blocks of 4; the last 2 tokens are no block
    assert a[1] == hash_block(a[0], [4, 5, 6, 7])
    b = extend_block_hashes([], [99] + list(range(1, 10)), BS)
    assert a[0] != b[0] and a[1] != b[1]  # the chain carries the first block's difference
    salted = extend_block_hashes([], list(range(10)), BS, "tenant-a")
    assert salted[0] != a[0] and salted[1] != a[1]
    assert hash_block(None, [1, 2, 3, 4], "") != hash_block(None, [1, 2, 3, 4], None)
    assert extend_block_hashes(list(a), list(range(13)), BS)[:2] == a  # extended, not redone


# ----------------------------------------------------------------------------- pool
def test_pool_evicts_the_least_recently_freed_cached_block_first():
    pool = BlockPool(4, BS)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]) * 32)
    pool.free([blocks[2], blocks[0]])        # freed in this order: 2 is evicted before 0
    assert pool.num_free_blocks == 2 and pool.lookup(bytes([2]) * 32) == blocks[2]
    [got] = pool.allocate(1)
    assert got == blocks[2] and pool.lookup(bytes([2]) * 32) is None and pool.num_evictions == 1
    pool.touch([blocks[0]])                  # a hit on a free cached block takes it back
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free_blocks == 0
    pool.touch([blocks[1]])                  # a hit on a held block shares it
    assert pool.ref_count(blocks[1]) == 2
    pool.free([blocks[1]])
    assert pool.ref_count(blocks[1]) == 1 and pool.num_free_blocks == 0
    with pytest.raises(BlockPoolError, match="uncached"):
        pool.free([got])
        pool.touch([got])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([got])


def test_reset_forgets_every_cached_block():
    pool = BlockPool(2, BS)
    b = pool.allocate(2)
    pool.cache_block(b[0], b"x" * 32)
    pool.free(b)
    assert pool.reset_cache() == 1 and pool.lookup(b"x" * 32) is None
    with pytest.raises(BlockPoolError):
        pool.touch([b[0]])


# ----------------------------------------------------------------------------- scheduler
def _sched(num_blocks=32, budget=64, caching=True, policy="chunked") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                     max_model_len=128, policy=policy),
                     KVCacheManager(num_blocks, BS, enable_prefix_caching=caching))


def _req(rid, ids, max_tokens=2, salt=None) -> Request:
    return Request(rid, list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens),
                   cache_salt=salt)


def _run(sched, req) -> tuple[int, list[int]]:
    """Add ``req``, run until it finishes; returns (start position of its first chunk, its
    output)."""
    sched.add_request(req)
    out, _ = drive_step(sched)
    first = [s for s in out.scheduled if s.request_id == req.request_id][0]
    while sched.has_unfinished():
        drive_step(sched)
    return first.num_computed_tokens, req.output_token_ids


PREFIX = list(range(100, 116))  # 4 full blocks


@pytest.mark.parametrize("shared,expect", [(0, 0), (1, 0), (BS, BS), (3 * BS, 3 * BS),
                                           (3 * BS + 1, 3 * BS), (4 * BS, 3 * BS)])
def test_a_request_starts_after_the_cached_full_blocks_it_shares(shared, expect):
    """Shared 0 tokens, 1 token, exactly k blocks, k blocks + 1 token; the whole 16-token prompt
    shared (then its last block is recomputed: the last token must produce logits)."""
    s = _sched()
    _run(s, _req("a", PREFIX))
    b = PREFIX[:shared] + [7000 + i for i in range(16 - shared)]
    start, out = _run(s, _req("b", b))
    assert start == expect
    assert out == expected_outputs("b", 2)
    assert s.kv.prefix_cache_queries == 32 and s.kv.prefix_cache_hits == expect
    assert s.kv.num_free_blocks == 32


def test_output_blocks_are_cached_too_and_a_finished_request_leaves_its_blocks_cached():
    s = _sched()
    _run(s, _req("a", PREFIX[:6], max_tokens=6))       # 6 prompt + 6 output: 11 computed
    a_tokens = PREFIX[:6] + expected_outputs("a", 6)
    start, _ = _run(s, _req("b", a_tokens[:11] + [1]))
    assert start == 8  # blocks 0 and 1 (positions 0..7) came back; block 2 was never full-computed


def test_salts_never_share_blocks():
    s = _sched()
    _run(s, _req("a", PREFIX, salt="tenant-a"))
    assert _run(s, _req("b", PREFIX, salt="tenant-b"))[0] == 0
    assert _run(s, _req("c", PREFIX))[0] == 0
    assert _run(s, _req("d", PREFIX, salt="tenant-a"))[0] == 3 * BS


def test_an_evicted_prefix_is_recomputed():
    s = _sched(num_blocks=6)
    _run(s, _req("a", PREFIX))                             # 5 blocks cached (4 + output)
    _run(s, _req("x", [9000 + i for i in range(20)]))      # needs 6 blocks: evicts them all
    assert _run(s, _req("b", PREFIX))[0] == 0
    assert s.kv.num_free_blocks == 6


def test_sharing_requests_hold_one_copy_and_free_it_once():
    s = _sched(budget=64)
    s.add_request(_req("a", PREFIX + [1, 2], max_tokens=8))
    drive_step(s)                                          # a's prompt computed and cached
    s.add_request(_req("b", PREFIX + [3, 4], max_tokens=8))
    out, _ = drive_step(s)
    ta, tb = s.kv.get_block_table("a"), s.kv.get_block_table("b")
    assert ta[:4] == tb[:4] and all(s.kv.pool.ref_count(b) == 2 for b in ta[:4])
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert all(s.kv.pool.ref_count(b) == 1 for b in tb[:4])
    while s.has_unfinished():
        drive_step(s)
    assert s.kv.num_free_blocks == 32


def test_preemption_while_blocks_are_shared_keeps_the_sharer_correct():
    """b is preempted while it shares a's prefix blocks; a keeps them; b comes back through the
    cache and both produce the outputs of an uninterrupted run."""
    s = _sched(num_blocks=9, budget=64)
    a, b = _req("a", PREFIX + [1, 2], max_tokens=12), _req("b", PREFIX + [3, 4], max_tokens=12)
    s.add_request(a)
    drive_step(s)
    s.add_request(b)
    preempted = []
    while s.has_unfinished():
        out, _ = drive_step(s)
        preempted += out.preempted_request_ids
        check_kv_invariants(s)
    assert preempted == ["b"] and b.num_preemptions == 1
    assert a.output_token_ids == expected_outputs("a", 12)
    assert b.output_token_ids == expected_outputs("b", 12)
    assert s.kv.num_free_blocks == 9 and s.kv.prefix_cache_hits >= 2 * 16


# ----------------------------------------------------------------------------- property test
@st.composite
def shared_workloads(draw):
    groups = [[draw(st.integers(10, 60)) for _ in range(draw(st.integers(1, 12)))]
              for _ in range(draw(st.integers(1, 3)))]
    specs = []
    for _ in range(draw(st.integers(1, 8))):
        g = draw(st.sampled_from(groups))
        cut = draw(st.integers(0, len(g)))
        tail = draw(st.lists(st.integers(10, 60), max_size=6))
        prompt = (g[:cut] + tail) or [11]
        specs.append((prompt, draw(st.integers(1, 10)), draw(st.integers(0, 10)),
                      draw(st.one_of(st.none(), st.integers(0, 25))),
                      draw(st.sampled_from([None, None, "s"]))))
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    need = max(cdiv(len(p) + m, block_size) for p, m, *_ in specs)
    return (specs, block_size, need + draw(st.integers(0, 4)), draw(st.integers(1, 24)),
            draw(st.sampled_from(["chunked", "naive", "static"])))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_workloads())
def test_random_shared_prefix_workloads_free_every_block(w):
    specs, block_size, num_blocks, budget, policy = w
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4,
                                  max_model_len=64, policy=policy),
                  KVCacheManager(num_blocks, block_size, enable_prefix_caching=True))
    reqs = {f"r{i}": Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m),
                             cache_salt=salt)
            for i, (p, m, _, _, salt) in enumerate(specs)}
    step, aborted = 0, set()
    while step <= max(a for _, _, a, _, _ in specs) or s.has_unfinished():
        for i, (_, _, arrival, abort_at, _) in enumerate(specs):
            rid = f"r{i}"
            if arrival == step:
                s.add_request(reqs[rid])
            if abort_at == step and rid in s.requests:
                s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        drive_step(s)  # a double free or a bad touch raises BlockPoolError
        check_kv_invariants(s)
        step += 1
        assert step < 2000, "no progress"
    assert s.kv.num_free_blocks == num_blocks and not s.kv.block_tables
    for rid, r in reqs.items():
        if rid not in aborted:
            assert r.output_token_ids == expected_outputs(rid, r.sampling_params.max_tokens)


# ----------------------------------------------------------------------------- real model
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    d = tmp_path_factory.mktemp("tiny-prefix")
    (d / "config.json").write_text(json.dumps(TINY))
    return LLMEngine(EngineConfig(model=str(d), load_format="dummy", dtype="float32",
                                  num_kv_blocks=40, max_num_batched_tokens=32, block_size=4))


def _greedy(eng, prompts, max_tokens=8) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o.token_ids, o.num_cached_tokens)
    return [done[i] for i in ids]


def test_greedy_output_identical_cold_warm_and_off(engine):
    base = [17 + (i * 37) % 400 for i in range(24)]       # 6 blocks of 4
    prompts = [base, base[:1] + [5] * 9, base[:8] + [9] * 5, base[:12] + [3],
               base[:13] + [4] * 3, base[:16]]
    kv = engine.kv
    kv.enable_prefix_caching = False
    off = _greedy(engine, prompts)
    assert all(c == 0 for _, c in off)
    kv.enable_prefix_caching = True
    engine.reset_prefix_cache()
    cold = [_greedy(engine, [p])[0] for p in [prompts[0]]]   # fills the cache with base
    warm = _greedy(engine, prompts)
    assert [t for t, _ in warm] == [t for t, _ in off]
    assert cold[0][0] == off[0][0]
    # cached: the whole prompt less its last token, floored to blocks (base + 8 outputs cached)
    assert [c for _, c in warm] == [20, 0, 8, 12, 12, 12]
    assert engine.kv.num_free_blocks == 40


def test_max_tokens_1_on_a_fully_cached_prompt_gives_the_cold_token(engine):
    p = [300 + i for i in range(16)]
    engine.reset_prefix_cache()
    [(cold, c0)] = _greedy(engine, [p], max_tokens=1)
    [(warm, c1)] = _greedy(engine, [p], max_tokens=1)
    assert c0 == 0 and c1 == 12 and warm == cold
