"""KVCacheSpec: the one formula for KV bytes per token and per block (engine, roofline,
simulator)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from sloserve.kv_cache_spec import KVCacheSpec

GiB = 1024 ** 3


def smollm2(dtype: str) -> KVCacheSpec:  # the embedded model: 30 layers, 3 KV heads of 64
    return KVCacheSpec(block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, num_layers=30)


@pytest.mark.parametrize("dtype,entry,width", [("float32", 256, 64), ("bfloat16", 128, 64),
                                               ("bf16", 128, 64), ("int8", 68, 68)])
def test_bytes_of_an_entry_a_token_and_a_block(dtype, entry, width):
    s = smollm2(dtype)
    assert (s.entry_bytes, s.entry_width) == (entry, width)
    assert s.bytes_per_token == 2 * 30 * 3 * entry
    assert s.page_size_bytes == 16 * 2 * 30 * 3 * entry
    assert s.num_blocks(10 * s.page_size_bytes - 1) == 9


def test_int8_counts_its_scale_and_mla_its_latent_once():
    assert smollm2("int8").scale_bytes == 4 and smollm2("bfloat16").scale_bytes == 0
    ds = KVCacheSpec(16, 1, 512 + 64, "bf16", 61, use_mla=True)
    assert ds.bytes_per_token == 70_272
    assert KVCacheSpec(16, 8, 128, "int4", 32).bytes_per_token == 2 * 32 * 8 * 64


def test_bad_specs_are_refused():
    with pytest.raises(KeyError, match="unknown dtype 'fp7'"):
        KVCacheSpec(16, 1, 64, "fp7", 1)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        KVCacheSpec(16, 1, 64, "bf16", 0)


def test_the_simulator_capacity_counts_the_int8_scale():
    from sloserve.sim.capacity import kv_blocks
    assert kv_blocks(1.0, "SmolLM2-135M", "bf16", 16) == GiB // (16 * 2 * 30 * 3 * 128) == 2912
    assert kv_blocks(1.0, "SmolLM2-135M", "int8", 16) == GiB // (16 * 2 * 30 * 3 * 68) == 5482


def test_the_engine_and_the_model_runner_do_not_import_the_roofline():
    code = ("import sys, sloserve.engine.core, sloserve.model.runner, sloserve.worker.worker; "
            "print([m for m in sys.modules if m.startswith('sloserve.roofline')])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
