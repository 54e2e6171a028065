"""KV formulas for MHA, GQA, MQA and MLA; dtypes; TP split."""
import dataclasses

import pytest

from sloserve.roofline.kv import kv_bytes_per_token, kv_bytes_per_token_per_gpu, kv_footprint
from sloserve.roofline.models import PRESETS

L8 = PRESETS["Llama-3-8B"]


def test_deepseek_v3_mla_bf16():
    assert kv_bytes_per_token(PRESETS["DeepSeek-V3"], "bf16") == (512 + 64) * 61 * 2 == 70_272
    assert PRESETS["DeepSeek-V3"].attention_kind == "MLA"


def test_mha_mqa_gqa():
    mha = dataclasses.replace(L8, num_kv_heads=32)
    mqa = dataclasses.replace(L8, num_kv_heads=1)
    assert (mha.attention_kind, mqa.attention_kind, L8.attention_kind) == ("MHA", "MQA", "GQA")
    assert kv_bytes_per_token(mha, "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288
    assert kv_bytes_per_token(mqa, "fp16") == 2 * 32 * 1 * 128 * 2 == 16_384
    assert kv_bytes_per_token(L8, "fp16") == 8 * kv_bytes_per_token(mqa, "fp16")


@pytest.mark.parametrize("dtype,factor", [("bf16", 1), ("fp16", 1), ("fp8", 0.5), ("int4", 0.25)])
def test_kv_dtypes(dtype, factor):
    assert kv_bytes_per_token(L8, dtype) == 131_072 * factor


def test_tp_split():
    assert kv_bytes_per_token_per_gpu(L8, "fp16", 8) == 131_072 / 8
    assert kv_bytes_per_token_per_gpu(L8, "fp16", 16) == 131_072 / 8  # kv heads replicated past 8
    mqa = dataclasses.replace(L8, num_kv_heads=1)
    assert kv_bytes_per_token_per_gpu(mqa, "fp16", 8) == kv_bytes_per_token(mqa, "fp16")
    ds = PRESETS["DeepSeek-V3"]
    assert kv_bytes_per_token_per_gpu(ds, "bf16", 8) == 70_272  # MLA latent replicated


def test_footprint():
    fp = kv_footprint(L8, 4, 1000, "fp8", tp=2)
    assert fp.total_bytes == 65_536 * 4000 and fp.per_gpu_bytes == fp.total_bytes / 2


def test_unknown_dtype():
    with pytest.raises(KeyError):
        kv_bytes_per_token(L8, "fp7")
