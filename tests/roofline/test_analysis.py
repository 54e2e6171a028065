"""Per-operator analysis, roofline placement, bounds and monotonicity."""
from itertools import pairwise

import pytest

from sloserve.roofline import bounds
from sloserve.roofline.hardware import HARDWARE
from sloserve.roofline.models import PRESETS
from sloserve.roofline.ops import Workload, analyze, operator_costs
from sloserve.roofline.report import plan
from sloserve.roofline.roofline import roofline_point
from sloserve.roofline.units import GiB

H100 = HARDWARE["H100-SXM"]
L8 = PRESETS["Llama-3-8B"]


def test_roofline_point():
    p = roofline_point(2e12, 1e10, H100, "bf16")  # 200 FLOP/byte < 295.2
    assert p.intensity == 200 and p.bound == "memory"
    assert p.attainable == 200 * 3.35e12 and p.time == 1e10 / 3.35e12
    q = roofline_point(1e15, 1e9, H100, "bf16")
    assert q.bound == "compute" and q.mfu == 1.0 and q.time == 1e15 / 989e12


def test_fp8_peak_missing_on_a100():
    with pytest.raises(KeyError):
        HARDWARE["A100-SXM-80GB"].peak("fp8")


def test_operator_names_and_decode_b1_close_to_weights_only():
    a = analyze(L8, Workload("decode", 1, 1024, "fp16", "fp16", "fp16"), H100)
    assert [o.name for o in a.ops] == ["qkv_proj", "attention", "o_proj", "mlp", "lm_head"]
    # weights only: 1 FLOP/byte; attention + KV add a little on both sides
    assert a.point.intensity == pytest.approx(1.0, abs=0.05)
    assert a.point.bound == "memory"
    # every weight matrix except the embedding table is read once
    wbytes = sum(o.weight_bytes for o in a.ops)
    assert wbytes == 2 * (L8.num_params() - L8.vocab_size * L8.hidden_size - L8.hidden_size * (2 * 32 + 1))
    attn = next(o for o in a.ops if o.name == "attention")
    assert attn.kv_bytes == 1024 * 131_072  # reads the whole context's KV
    assert attn.flops == 32 * 2 * 1024 * 32 * (128 + 128)


def test_prefill_causal_pairs():
    ops = {o.name: o for o in operator_costs(L8, Workload("prefill", 2, 100))}
    assert ops["attention"].flops == 32 * 2 * (2 * 100 * 101 // 2) * 32 * 256
    assert ops["lm_head"].flops == 2 * 2 * 4096 * 128256  # last position only
    assert ops["mlp"].flops == 32 * 2 * 200 * 3 * 4096 * 14336


def test_decode_intensity_grows_with_batch():
    xs = [analyze(L8, Workload("decode", b, 2048), H100).point.intensity for b in (1, 2, 4, 16, 64, 256)]
    assert all(a < b for a, b in pairwise(xs))


def test_prefill_intensity_grows_with_prompt():
    xs = [analyze(L8, Workload("prefill", 1, t), H100).point.intensity for t in (16, 128, 1024)]
    assert all(a < b for a, b in pairwise(xs))
    assert analyze(L8, Workload("prefill", 1, 1024), H100).point.bound == "compute"


def test_moe_touched_experts():
    ds = PRESETS["DeepSeek-V3"]
    b1 = analyze(ds, Workload("decode", 1, 1024, "fp8"), HARDWARE["H200-SXM"])
    w1 = sum(o.weight_bytes for o in b1.ops)
    assert w1 == pytest.approx(ds.active_params() - ds.vocab_size * ds.hidden_size, rel=0.02)
    big = analyze(ds, Workload("decode", 4096, 1024, "fp8"), HARDWARE["H200-SXM"])
    assert sum(o.weight_bytes for o in big.ops) == pytest.approx(
        ds.num_params() - ds.vocab_size * ds.hidden_size, rel=0.01)


def test_bounds():
    assert bounds.decode_step_time(140e9, 2e12) == 0.07
    assert bounds.decode_step_time(37.5e9, 3.35e12, 0.8) == pytest.approx(0.013993, abs=1e-6)
    assert bounds.prefill_time(989e12, 989e12, 0.5) == 2.0
    d = bounds.decode_bound(0.02, 8)
    assert (d.user_tokens_per_s, d.batch_tokens_per_s) == (50.0, 400.0)
    assert bounds.max_batch(80 * GiB, 16e9, 1 * GiB, 4 * GiB) == int((80 * GiB - 16e9 - 4 * GiB) // GiB)
    assert bounds.max_batch(10e9, 16e9, 1e9) == 0


def test_kv_transfer_eager_vs_pipelined():
    # transfer (1 s) shorter than prefill (2 s): only the last layer's share is exposed
    t = bounds.kv_transfer(10e9, 10e9, 2.0, 10)
    assert t.eager_exposed == 1.0 and t.pipelined_exposed == pytest.approx(0.1)
    # transfer (4 s) longer than prefill (2 s): X - P + P/L
    t = bounds.kv_transfer(40e9, 10e9, 2.0, 10)
    assert t.eager_exposed == 4.0 and t.pipelined_exposed == pytest.approx(4 - 2 + 0.2)


def test_plan_max_batch_shrinks_with_context():
    pl = plan(PRESETS["Llama-3-70B"], H100, tp=8, weight_dtype="fp16", batch=128, context_len=4096)
    mb = [pl.max_batch[s] for s in sorted(pl.max_batch)]
    assert all(a >= b for a, b in pairwise(mb)) and mb[0] > mb[-1] > 0
    assert pl.kv_total["per_gpu_bytes"] == 20 * GiB
    assert pl.weight_bytes_per_gpu == pl.weight_bytes / 8


def test_plan_tp_divides_decode_time():
    one = plan(L8, H100, batch=8, context_len=2048)
    two = plan(L8, H100, batch=8, context_len=2048, tp=2)
    assert two.decode_step_seconds == pytest.approx(one.decode_step_seconds / 2)
