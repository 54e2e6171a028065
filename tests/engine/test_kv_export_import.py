"""KV export/import on the model runner (the seam of a KV connector): a request's KV moved to
fresh blocks mid-decode, all layers at once or layer by layer, decodes on identically."""
from __future__ import annotations

import pytest

import sloserve
from sloserve.sampling_params import SamplingParams

from .conftest import check_kv_invariants


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, single_thread):
    return sloserve.LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, block_size=4,
                        max_num_batched_tokens=64)


PROMPT = [11 + 5 * j for j in range(13)]
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _generate(llm, move_after: int | None, per_layer: bool = False) -> list[int]:
    eng = llm.engine
    rid = eng.add_request(PROMPT, SP)
    # another request first, so the moved request's blocks are not the pool's first ones
    other = eng.add_request(PROMPT[:5], SP)
    steps, final = 0, None
    while eng.has_unfinished_requests():
        if steps == move_after:
            _move(eng, rid, per_layer)
        for o in eng.step():
            if o.request_id == rid and o.finished:
                final = o.token_ids
        steps += 1
    assert eng.kv.num_free_blocks == eng.num_kv_blocks
    del other
    return final


def _move(eng, rid: str, per_layer: bool) -> None:
    kv, runner = eng.kv, eng.runner
    old = list(kv.get_block_table(rid))
    new = kv.pool.allocate(len(old))
    assert new is not None and not set(new) & set(old)
    if per_layer:  # layer-wise, as a connector streaming layer by layer would
        for layer in range(len(runner.kv_caches)):
            runner.import_kv(new, runner.export_kv(old, layer=layer), layer=layer)
    else:
        buf = runner.export_kv(old)
        n_tokens = len(old) * eng.config.block_size
        assert buf.numel() * buf.element_size() == n_tokens * runner.kv_bytes_per_token
        assert buf.is_contiguous()
        runner.import_kv(new, buf)
    for b in old:  # scribble over the old blocks: decoding must not read them any more
        for cache in runner.kv_caches:
            cache[:, b].fill_(1e4)
    kv.block_tables[rid] = new
    kv.pool.free(old)
    check_kv_invariants(eng.scheduler)


@pytest.mark.parametrize("per_layer", [False, True])
def test_moved_kv_decodes_identically(llm, per_layer):
    ref = _generate(llm, None)
    assert len(ref) == 16
    assert _generate(llm, move_after=3, per_layer=per_layer) == ref


def test_import_refuses_a_buffer_of_the_wrong_shape(llm):
    runner = llm.engine.runner
    buf = runner.export_kv([1, 2])
    with pytest.raises(ValueError, match="does not fit 3 blocks"):
        runner.import_kv([3, 4, 5], buf)
    with pytest.raises(ValueError, match="holds 1 layers, expected 2"):
        runner.import_kv([3, 4], buf[:1])
