"""Unit conversions, the hardware table and the cached local measurement."""
import json

import pytest

from sloserve.roofline.hardware import HARDWARE, NIC_PRESETS, get_hardware, get_link, measure_local
from sloserve.roofline.units import GB, GiB, fmt_bandwidth, fmt_bytes, fmt_flops_rate, fmt_time


def test_unit_constants():
    assert GiB == 1_073_741_824 and GB == 10**9
    assert 10 * GiB / GB == pytest.approx(10.737418, abs=1e-6)
    assert NIC_PRESETS["nic-400g"].bandwidth == 50 * GB
    assert NIC_PRESETS["nic-100g"].bandwidth == 12.5 * GB


def test_formatting_shows_both_units():
    assert fmt_bytes(10 * GiB) == "10.00 GiB (10.74 GB)"
    assert fmt_bytes(140 * GB) == "130.39 GiB (140.00 GB)"
    assert fmt_bytes(2**30 * 1000) == "1000.00 GiB (1073.74 GB)"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(128 * 2**20) == "128.00 MiB (134.22 MB)"
    assert fmt_flops_rate(989e12) == "989.00 TFLOP/s"
    assert fmt_bandwidth(3.35e12) == "3.35 TB/s"
    assert fmt_time(0.014) == "14.000 ms"


def test_table_has_all_parts_and_dtypes():
    assert set(HARDWARE) == {"A100-SXM-80GB", "H100-SXM", "H200-SXM", "B200", "L40S", "MI300X"}
    for hw in HARDWARE.values():
        assert {"fp32", "bf16", "fp16", "int8"} <= set(hw.peak_flops), hw.name
        assert hw.source and hw.mem_bandwidth > 0 and hw.mem_bytes > 0 and hw.link is not None
        assert hw.peak("fp16") == hw.peak("bf16")
    assert "fp8" not in HARDWARE["A100-SXM-80GB"].peak_flops
    assert get_hardware("h100-sxm") is HARDWARE["H100-SXM"]
    assert get_link("nvlink", HARDWARE["H100-SXM"]).bandwidth == 450 * GB
    with pytest.raises(KeyError):
        get_hardware("TPU-v9")


def test_local_measurement_is_cached(tmp_path, monkeypatch):
    cache = tmp_path / "sub" / "local.json"
    hw = measure_local(str(cache), stream_bytes=2**20, matmul_n=64, repeats=2)
    assert hw.name == "local" and hw.peak("fp32") > 0 and hw.mem_bandwidth > 0
    d = json.loads(cache.read_text())
    assert d["fp32"] == hw.peak("fp32")
    d["fp32"] = 123.0  # a second call reads the file instead of measuring
    cache.write_text(json.dumps(d))
    assert measure_local(str(cache)).peak("fp32") == 123.0
    assert get_hardware("local", cache_path=str(cache)).peak("fp32") == 123.0
    assert hw.peak("bf16") > 0  # measured with torch, the engine's own kernels
