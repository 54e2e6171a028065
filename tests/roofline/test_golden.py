"""The lecture's worked numbers, exact where the arithmetic is self-consistent."""
import pytest

from sloserve.roofline.hardware import HARDWARE
from sloserve.roofline.kv import kv_bytes_per_token, kv_footprint
from sloserve.roofline.models import PRESETS
from sloserve.roofline.textbook import (
    decode_intensity_weights_only,
    golden_numbers,
    lecture_table,
    naive_attention,
    prefill_intensity_weights_only,
    unit_slips,
    weight_bytes,
)
from sloserve.roofline.units import GB, TB, GiB, MiB

H100, A100 = HARDWARE["H100-SXM"], HARDWARE["A100-SXM-80GB"]


def test_balance_points():
    assert H100.balance_point("bf16") == 989e12 / 3.35e12
    assert round(H100.balance_point("fp16"), 1) == 295.2
    assert round(A100.balance_point("bf16"), 1) == 153.0


def test_decode_batch1_on_h100():
    i = decode_intensity_weights_only(1, weight_bytes=2)
    assert i == 1.0
    att = min(H100.peak("fp16"), i * H100.mem_bandwidth)
    assert att == 3.35e12
    assert round(100 * att / H100.peak("fp16"), 2) == 0.34


def test_decode_batch128_mfu_about_43_percent():
    i = decode_intensity_weights_only(128)
    mfu = min(H100.peak("fp16"), i * H100.mem_bandwidth) / H100.peak("fp16")
    assert round(100 * mfu) == 43
    assert mfu == pytest.approx(428.8 / 989)


def test_prefill_1024_intensity():
    assert prefill_intensity_weights_only(1024) == 1024


def test_llama3_kv_bytes_per_token():
    assert kv_bytes_per_token(PRESETS["Llama-3-8B"], "fp16") == 131_072
    assert kv_bytes_per_token(PRESETS["Llama-3-70B"], "fp16") == 327_680


def test_70b_kv_128x4096_and_tp8():
    fp = kv_footprint(PRESETS["Llama-3-70B"], 128, 4096, "fp16", tp=8)
    assert fp.total_bytes == 160 * GiB
    assert fp.per_gpu_bytes == 20 * GiB


def test_70b_weights():
    assert weight_bytes(70e9, 2) == 140 * GB
    assert weight_bytes(70e9, 2, tp=8) == 17.5 * GB


def test_70b_batch1_decode_on_a100_at_2tbps():
    assert weight_bytes(70e9, 2) / (2 * TB) == pytest.approx(0.070, abs=1e-15)
    assert weight_bytes(70e9, 2) / A100.mem_bandwidth < 0.070  # 2.039 TB/s is a bit faster


def test_naive_attention():
    a = naive_attention(8192, 128)
    assert a.score_bytes == 128 * MiB
    assert a.intensity == pytest.approx(2 * 128 / 3)
    assert round(a.intensity, 1) == 85.3
    assert naive_attention(8192, 128, passes=4).intensity == 64.0


def test_lecture_table_row_by_row():
    rows = [(r.label, r.intensity, round(r.attainable / 1e12, 3), round(100 * r.mfu, 2), r.bound,
             round(r.time * 1e3, 3)) for r in lecture_table()]
    assert rows == [
        ("8B decode B=1", 1.0, 3.35, 0.34, "memory", 4.776),
        ("8B decode B=16", 16.0, 53.6, 5.42, "memory", 4.776),
        ("8B decode B=128", 128.0, 428.8, 43.36, "memory", 4.776),
        ("8B decode B=256", 256.0, 857.6, 86.71, "memory", 4.776),
        ("8B prefill 1024", 1024.0, 989.0, 100.0, "compute", 16.566),
        ("70B/8 decode B=1", 1.0, 2.039, 0.65, "memory", 8.583),
        ("70B/8 prefill 1024", 1024.0, 312.0, 100.0, "compute", 57.436),
    ]


def test_unit_slips_exact_values():
    s = unit_slips()
    k = s["kv_32k_70b"]
    assert k["bytes"] == 10 * GiB == 10_737_418_240
    assert round(k["GB"], 2) == 10.74
    # the text's 10.48 GB: 32K read as 32,000 tokens (= 10 x 1.024**2 GB), cut to two decimals
    assert k["text_bytes"] == 327_680 * 32_000 == 10 * 1.024**2 * GB
    assert int(k["text_bytes"] / GB * 100) / 100 == k["text_GB"] == 10.48
    t = s["tpot_70b_tp8_h100"]
    assert round(t["text_seconds"] * 1e3, 1) == 14.0  # 20 GiB read as 20 GB
    assert t["exact_seconds"] == pytest.approx((17.5e9 + 20 * 2**30) / (3.35e12 * 0.8))
    assert round(t["exact_seconds"] * 1e3, 2) == 14.54


def test_golden_numbers_dict_is_consistent():
    g = golden_numbers()
    assert g["kv_128x4096_70b_GiB"] == 160.0
    assert g["kv_128x4096_70b_per_gpu_tp8_GiB"] == 20.0
    assert g["weights_70b_fp16_per_gpu_tp8_GB"] == 17.5
    assert g["naive_attention_8192_score_MiB"] == 128.0
