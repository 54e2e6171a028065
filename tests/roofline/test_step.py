"""The roofline of a step of any composition (``sloserve.roofline.step``), the attention work
it prices (``sloserve.step_io.attention_work``), the served model's bound from the engine's
``model_shape``, and the cached local measurement it reads (never measuring)."""
from __future__ import annotations

import json

import pytest

from sloserve.roofline import hardware
from sloserve.roofline.hardware import Hardware, cached_local
from sloserve.roofline.models import get_model
from sloserve.roofline.step import StepRoofline, served_roofline
from sloserve.step_io import attention_work

HW = Hardware("test", {"fp32": 1e12, "bf16": 4e12}, 100e9, 0)


def test_attention_work_counts_pairs_and_kv_tokens_exactly():
    # two decodes at contexts 10 and 20; a chunk of 4 tokens at start 6; one of 3 at 0
    assert attention_work((10, 20), ((4, 6), (3, 0))) == (10 + 20 + (4 * 6 + 10) + 6, 30 + 10 + 3)
    # a decode verifying 3 drafts at context 12: its 4 query rows see 9, 10, 11, 12 keys
    assert attention_work((12,), (), (3,)) == (9 + 10 + 11 + 12, 12)


def test_a_decode_is_bound_by_the_weights_and_a_long_prefill_by_the_flops():
    spec = get_model("Llama-3-8B")
    r = StepRoofline(spec, HW, "bf16")
    w = r.per["weights"]
    assert 14e9 < w < 17e9  # 8B x 2 bytes
    t = r.seconds(1, 1, *attention_work((1,), ()))
    flops, nbytes = r.flops_bytes(1, 1, *attention_work((1,), ()))
    assert t == nbytes / HW.mem_bandwidth and w <= nbytes < w * 1.01
    pairs, kv = attention_work((), ((2048, 0),))
    flops, nbytes = r.flops_bytes(2048, 1, pairs, kv)
    assert r.seconds(2048, 1, pairs, kv) == flops / 4e12 > nbytes / HW.mem_bandwidth
    # ~2 x params per token, the LM head once for the sequence
    assert flops == pytest.approx(2 * 7e9 * 2048, rel=0.15)
    # the weight bytes the engine reads replace the dtype's; the peak can be given
    q = StepRoofline(spec, HW, "bf16", weight_bytes=4.5e9, peak=1e12)
    assert q.per["weights"] == 4.5e9 and q.peak == 1e12
    assert q.seconds(1, 1, 1, 1) < t


def test_served_roofline_from_the_engines_shape():
    shape = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
             "vocab_size": 49152, "tie_word_embeddings": True, "attention_bias": False,
             "weight_bytes": 96_600_000}
    r = served_roofline(shape, "bfloat16", "int8", hw=HW)
    assert r.per["weights"] == 96_600_000 and r.peak == 4e12  # the fastest measured peak
    assert r.dtype == "bf16" and r.kv_dtype == "int8"
    assert r.per["kv_token_bytes"] == 30 * 2 * 3 * 64 * 1  # int8 K and V of 3 KV heads
    assert served_roofline({}, "bfloat16", "bfloat16", hw=HW) is None


def test_cached_local_reads_this_machines_measurement_only(tmp_path, monkeypatch):
    path = tmp_path / "local.json"
    monkeypatch.setattr(hardware, "_read_bandwidth",
                        lambda *a: pytest.fail("cached_local must not measure"))
    assert cached_local(str(path)) is None
    d = {"key": hardware._local_key(), "fp32": 2e11, "mem_bandwidth": 3e10, "mem_bytes": 1,
         "method": "m", "measured_at": "t"}
    path.write_text(json.dumps(d))
    hw = cached_local(str(path))
    assert hw.peak("fp32") == 2e11 and hw.mem_bandwidth == 3e10
    path.write_text(json.dumps({**d, "key": {**d["key"], "node": "another-host"}}))
    assert cached_local(str(path)) is None
    path.write_text("{not json")
    assert cached_local(str(path)) is None


def test_a_step_that_beats_a_roof_raises_it_so_the_bound_stays_below_every_step():
    spec = get_model("Llama-3-8B")
    r = StepRoofline(spec, HW, "bf16")
    pairs, kv = attention_work((), ((2048, 0),))
    flops, nbytes = r.flops_bytes(2048, 1, pairs, kv)
    slow = 2 * flops / 4e12
    assert r.observe(2048, 1, pairs, kv, slow) == flops / 4e12 and r.peak == 4e12
    fast = flops / 8e12  # the engine's kernels beat the measured matmul peak
    assert r.observe(2048, 1, pairs, kv, fast) == pytest.approx(fast)
    assert r.peak == pytest.approx(8e12) and r.measured == (4e12, HW.mem_bandwidth)
    d_pairs, d_kv = attention_work((100,), ())
    _, d_bytes = r.flops_bytes(1, 1, d_pairs, d_kv)
    assert r.observe(1, 1, d_pairs, d_kv, d_bytes / 2e11) == pytest.approx(d_bytes / 2e11)
    assert r.bandwidth == pytest.approx(2e11)  # a decode faster than the probe's bandwidth
    assert r.seconds(2048, 1, pairs, kv) <= slow
