"""The dtype the engine picks for the CPU it finds (sloserve.platform)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sloserve.cpus import CpuBudget
from sloserve.platform import (BF16_MAX_GEMM_RATIO, DTYPES, MatmulProbe, choose_dtype,
                               decide_dtype, detect_cpu)

NATIVE = MatmulProbe(gemm_fp32_s=2e-4, gemm_bf16_s=1e-4, gemv_fp32_s=1.6e-4, gemv_bf16_s=1.5e-4)
EMULATED = MatmulProbe(gemm_fp32_s=1.5e-4, gemm_bf16_s=3e-2, gemv_fp32_s=1.6e-4, gemv_bf16_s=5e-4)


def test_auto_picks_bf16_only_where_its_matmul_is_native():
    assert decide_dtype("auto", NATIVE)[0] == "bfloat16"
    dtype, reason = decide_dtype("auto", EMULATED)
    assert dtype == "float32"
    assert "emulated" in reason and "200.00x" in reason  # the GEMM ratio is named


def test_auto_thresholds():
    at = MatmulProbe(1e-4, 1e-4 * BF16_MAX_GEMM_RATIO, 1e-4, 1e-4)
    assert decide_dtype("auto", at)[0] == "bfloat16"
    just_over = MatmulProbe(1e-4, 1.01e-4 * BF16_MAX_GEMM_RATIO, 1e-4, 1e-4)
    assert decide_dtype("auto", just_over)[0] == "float32"
    slow_gemv = MatmulProbe(1e-4, 0.5e-4, 1e-4, 2.5e-4)  # the AVX2-only host: ~3x per GEMV
    assert decide_dtype("auto", slow_gemv)[0] == "float32"


def test_explicit_dtype_is_kept_and_warned_about_when_emulated():
    dtype, reason = decide_dtype("bfloat16", EMULATED)
    assert dtype == "bfloat16" and "emulated" in reason and "--dtype float32" in reason
    assert decide_dtype("bfloat16", NATIVE) == ("bfloat16", "as requested (bf16/fp32 time: GEMM "
                                                "0.50x, GEMV 0.94x)")
    assert decide_dtype("float32", None) == ("float32", "as requested")


def test_bad_dtypes_are_refused():
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16"):
        decide_dtype("int3", NATIVE)
    with pytest.raises(ValueError, match="needs a matmul probe"):
        decide_dtype("auto", None)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        choose_dtype("float32", "fp8")


def test_float32_needs_no_probe_and_kv_follows_or_overrides():
    c = choose_dtype("float32")
    assert (c.dtype, c.kv_cache_dtype, c.probe) == ("float32", "float32", None)
    assert choose_dtype("float32", "bfloat16").kv_cache_dtype == "bfloat16"
    assert choose_dtype("float32", "int8").kv_cache_dtype == "int8"
    assert "KV cache int8" in choose_dtype("float32", "int8").describe()
    line = c.describe()
    assert line.startswith("cpu: ") and "-> dtype float32, KV cache float32" in line
    assert "torch threads" in line


def test_detect_cpu_reports_known_flags_only():
    cpu = detect_cpu()
    from sloserve.platform import ISA_FLAGS
    assert set(cpu.flags) <= set(ISA_FLAGS)
    assert list(cpu.flags) == [f for f in ISA_FLAGS if f in cpu.flags]
    assert cpu.aten_capability


_CHILD = ("import json; from sloserve.platform import choose_dtype; c = choose_dtype('auto'); "
          "print(json.dumps([c.dtype, c.cpu.aten_capability, c.probe.gemm_ratio]))")


def test_under_avx2_caps_auto_falls_back_to_float32():
    """What an AVX2/FMA-only host sees: torch and oneDNN capped at AVX2 emulate bf16 math, so
    auto must compute in float32 (true on both CPU kinds: on an AVX2 host the caps change
    nothing)."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    dtype, cap, ratio = json.loads(out.stdout.strip().splitlines()[-1])
    assert cap == "AVX2"
    assert ratio > BF16_MAX_GEMM_RATIO, f"bf16 GEMM only {ratio:.2f}x fp32's time under AVX2 caps"
    assert dtype == "float32"


def test_the_cpu_line_names_the_threads_and_their_source():
    line = choose_dtype("float32", budget=CpuBudget(3, "--num-threads", 2, None)).describe()
    assert "; threads 3 (--num-threads; affinity 2, quota none) -> dtype float32" in line


def test_engine_logs_its_choice(tiny_llama_dir, caplog):
    from sloserve.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    caplog.set_level("INFO", logger="sloserve.worker.worker")  # the worker chooses the dtypes
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", kv_cache_dtype="bfloat16",
                                 num_kv_blocks=16))
    assert eng.runner.kv_caches[0][0].dtype.__repr__() == "torch.bfloat16"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu: ")]
    assert len(lines) == 1 and "-> dtype float32, KV cache bfloat16" in lines[0]
    assert set(DTYPES) >= {eng.dtype_choice.dtype}
    # the threads and where their count came from (this test process may run fewer than the
    # CPUs it has: the line then says torch's count was kept)
    budget = eng.dtype_choice.cpu.budget
    assert f"; {budget.describe()} -> dtype" in lines[0]
    assert budget.source in ("detected", "torch", "OMP_NUM_THREADS")
    worker = eng.core.model_executor.driver_worker
    assert (worker.thread_governor is not None) == (budget.source in ("detected", "torch"))


def test_the_probe_alternates_its_dtypes_so_a_burst_hits_both(monkeypatch):
    """A neighbour's burst over one dtype's back-to-back runs once made the bf16 GEMV read 6.2x
    float32's time and the engine serve float32; the probe now alternates the two dtypes' calls
    (a burst slows both) and keeps each one's best."""
    import torch
    from sloserve import platform

    calls: list[tuple[int, torch.dtype]] = []
    real = torch.nn.functional.linear

    def recording(x, w, *a):
        calls.append((x.shape[0], x.dtype))
        return real(x, w, *a)
    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    p = platform.probe_matmul(repeats=4)
    assert all(t > 0 for t in (p.gemm_fp32_s, p.gemm_bf16_s, p.gemv_fp32_s, p.gemv_bf16_s))
    for rows in (32, 1):
        seq = [d for m, d in calls if m == rows][2:]  # after each dtype's untimed first call
        assert seq == [torch.float32, torch.bfloat16] * 4
