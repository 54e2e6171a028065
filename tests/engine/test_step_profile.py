"""step_profile drives steps of an exact composition and leaves the engine empty."""
from __future__ import annotations

import pytest

import sloserve
from sloserve.tools.step_profile import time_decode_steps, time_mixed_steps


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4,
                        max_num_batched_tokens=64).engine


@pytest.mark.parametrize("chunk", [0, 5, 12])
def test_mixed_steps_have_the_asked_composition_and_free_everything(engine, chunk):
    samples = time_mixed_steps(engine, batch=3, context_len=9, chunk=chunk, warmup=1, repeats=3)
    assert len(samples) == 3
    assert [s.context for s in samples] == [11, 12, 13]  # context_len + step index + 1
    assert all(s.wall_s >= s.forward_s > 0 for s in samples)
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == 64


def test_mixed_steps_refuse_a_busy_engine_or_too_few_blocks(engine):
    with pytest.raises(ValueError, match="need 66 KV blocks; the engine has 64"):
        time_mixed_steps(engine, batch=8, context_len=30, chunk=4, warmup=1, repeats=1)
    rid = engine.add_request([11, 12, 13], sloserve.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="idle engine"):
        time_mixed_steps(engine, batch=1, context_len=4, chunk=0, warmup=0, repeats=1)
    engine.abort_request(rid)


def test_decode_steps_still_pure(engine):
    samples = time_decode_steps(engine, batch=2, context_len=12, warmup=1, repeats=2)
    assert len(samples) == 2 and len({s.context for s in samples}) == 2
    assert engine.kv.num_free_blocks == 64
