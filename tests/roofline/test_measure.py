"""``--measure`` / ``--plot``: the engine-timing code path on a tiny dummy model, and the chart."""
from __future__ import annotations

import json
import statistics

import pytest

from sloserve.config import EngineConfig
from sloserve.roofline.cli import main
from sloserve.roofline.hardware import measure_local
from sloserve.roofline.models import get_model
from sloserve.roofline.roofline import roofline_point
from sloserve.roofline.ops import Workload, operator_costs
from sloserve.tools.roofline_measure import measure

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-roofline")
    (d / "config.json").write_text(json.dumps(TINY))
    return str(d)


@pytest.fixture(scope="module")
def local_hw(tmp_path_factory):
    # small arrays: a fast, fresh measurement that does not touch the user's cache
    return measure_local(str(tmp_path_factory.mktemp("hw") / "local.json"), stream_bytes=8 * 2**20,
                         matmul_n=128, repeats=2)


def test_measure_structure_and_exact_ratios(tiny_dir, local_hw):
    spec = get_model(tiny_dir)
    m = measure(EngineConfig(model=tiny_dir, load_format="dummy", dtype="float32", num_kv_blocks=64),
                spec, local_hw, decode_batches=(1, 3), context_len=24, prefill_chunks=(8, 32),
                warmup=1, repeats=3, prefill_warmup=1, prefill_repeats=2)
    assert [(p.phase, p.batch, p.seq_len) for p in m.points] == \
        [("decode", 1, 24), ("decode", 3, 24), ("prefill", 1, 8), ("prefill", 1, 32)]
    assert m.ops_dtype == m.peak_dtype == "fp32" and m.peak == local_hw.peak("fp32")
    for p in m.points:
        assert len(p.samples_s) == (3 if p.phase == "decode" else 2)
        assert p.measured_s > 0 and p.measured_s == statistics.median(p.samples_s)
        ops = operator_costs(spec, Workload(p.phase, p.batch, p.seq_len, "fp32", "fp32", "fp32"))
        assert p.flops == sum(o.flops for o in ops) and p.bytes == sum(o.bytes for o in ops)
        rp = roofline_point(p.flops, p.bytes, local_hw, "fp32")
        assert p.bound_s == rp.time == max(p.flops / m.peak, p.bytes / m.bandwidth)
        assert p.efficiency == p.bound_s / p.measured_s
        assert p.achieved_flops_per_s == p.flops / p.measured_s
        assert p.achieved_bytes_per_s == p.bytes / p.measured_s
        if p.phase == "decode":  # also set against the probe's reading around the point
            assert p.bandwidth_at > 0 and p.efficiency_at == max(
                p.flops / p.peak, p.bytes / p.bandwidth_at) / p.measured_s
        else:
            assert p.bandwidth_at == p.efficiency_at == 0
    assert m.points[0].contexts == [23, 24, 25]  # centred on the stated context
    assert any(n.startswith("decode against the read bandwidth measured around each point")
               and "decode B=3" in n for n in m.notes)
    d = m.to_dict()
    assert json.loads(json.dumps(d))["points"][1]["label"] == "decode B=3"


def test_measure_bf16_falls_back_to_fp32_peak(tiny_dir, local_hw):
    import dataclasses
    local_hw = dataclasses.replace(local_hw, peak_flops={"fp32": local_hw.peak("fp32")})  # no bf16
    m = measure(EngineConfig(model=tiny_dir, load_format="dummy", dtype="bfloat16"), get_model(tiny_dir),
                local_hw, decode_batches=(2,), context_len=8, prefill_chunks=(4,), warmup=0, repeats=1,
                prefill_warmup=0, prefill_repeats=1)
    assert m.ops_dtype == "bf16" and m.peak_dtype == "fp32"
    assert any("no bf16 peak" in n and "fp32" in n for n in m.notes)


def test_cli_measure_json_and_plot(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # the local-hardware cache goes to tmp
    import sloserve.roofline.hardware as hwmod
    monkeypatch.setattr(hwmod, "DEFAULT_CACHE", str(tmp_path / "local.json"))
    real = hwmod.measure_local
    monkeypatch.setattr(hwmod, "measure_local", lambda path, remeasure=False: real(
        path, remeasure, stream_bytes=8 * 2**20, matmul_n=128, repeats=2))
    png = tmp_path / "r.png"
    from sloserve.cli import main as sloserve_main  # `sloserve roofline` hands in the engine's measure

    assert sloserve_main(["roofline", "--hardware", "local", "--model", tiny_dir, "--load-format", "dummy",
                          "--dtype", "float32", "--measure", "--measure-batches", "1,2",
                          "--measure-context-len", "16", "--measure-chunks", "8", "--warmup", "0",
                          "--repeats", "1", "--prefill-repeats", "1", "--batch", "2", "--context-len",
                          "64", "--prompt-len", "32", "--json", "--plot", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [p["label"] for p in d["measure"]["points"]] == ["decode B=1", "decode B=2", "prefill 8"]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_plot_without_measure(tmp_path, capsys):
    png = tmp_path / "roof.png"
    assert main(["--model", "Llama-3-8B", "--hardware", "H100-SXM", "--plot", str(png)]) == 0
    assert "plot written to" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_measure_needs_the_engine_handed_in(tiny_dir, capsys):
    """sloserve.roofline imports no engine: without a measure function --measure is refused."""
    assert main(["--hardware", "H100-SXM", "--model", tiny_dir, "--load-format", "dummy",
                 "--measure"]) == 2
    assert "use `sloserve roofline --measure`" in capsys.readouterr().err


def test_measure_rejects_preset(capsys):
    assert main(["--model", "Llama-3-8B", "--hardware", "H100-SXM", "--measure"]) == 2
    assert "--measure needs a model the engine can load" in capsys.readouterr().err


def test_model_flag_without_value_is_embedded():
    from sloserve.roofline.cli import EMBEDDED, build_parser

    assert build_parser().parse_args(["--model"]).model == EMBEDDED
    assert build_parser().parse_args([]).model is None


def _fake_model(policy, quant_method, dtype):
    """What ``served_format`` reads of a model whose ops run on the kernels: its policy, layer
    0's gate/up quantized method (or None), its dtype."""
    import types
    ns = types.SimpleNamespace
    gate_up = ns(quant_method=quant_method)
    return ns(kernels=object(), policy=policy, lm_head=ns(weight=ns(dtype=dtype)),
              model=ns(layers=[ns(mlp=ns(gate_up_proj=gate_up))]))


def test_quantized_steps_count_the_served_bytes_and_kernel_peak(tiny_dir, local_hw):
    """A step on quantized weights counts their stored bytes (not the dense dtype's) and the
    kernel's int8-dot peak, the best of the largest step's row count and its own (each
    measured once); a step above the crossover stays dense."""
    import types
    from sloserve.tools import roofline_measure as mm
    spec = get_model(tiny_dir)
    import torch
    from sloserve.model.layers.linear import LinearPolicy
    method = types.SimpleNamespace(int8_activations=True, weights=[object()])
    model = _fake_model(LinearPolicy(quant_max_tokens=4), method, torch.bfloat16)
    model.quantized_weight_bytes = 12_345
    eng = types.SimpleNamespace(runner=types.SimpleNamespace(model=model))
    calls = []
    orig = mm.kernel_peak
    measured = {4: 7e11, 3: 8e11, 1: 1e11}
    mm.kernel_peak = lambda f, m: calls.append(m) or measured[m]
    try:
        peaks: dict = {}
        q3 = mm.served_format(eng, 3, peaks)
        assert q3.peak == 8e11  # its own row count ran faster than the largest step's
        assert mm.served_format(eng, 5, peaks) is None
        q = mm.served_format(eng, 1, peaks)
        assert mm.served_format(eng, 3, peaks) == q3
        assert sorted(calls) == [1, 3, 4]  # each row count measured once
    finally:
        mm.kernel_peak = orig
    assert q.weight_bytes == 12_345 and q.peak == 7e11 and "int8" in q.name
    wl = Workload("decode", 3, 24, "fp32", "fp32", "fp32")
    p = mm.theory(spec, wl, local_hw, "fp32", 1e-3, [1e-3], None, q)
    ops = operator_costs(spec, wl)
    assert p.bytes == sum(o.bytes for o in ops) - sum(o.weight_bytes for o in ops) + 12_345
    assert p.flops == sum(o.flops for o in ops) and p.peak == 7e11
    assert p.bound_s == max(p.flops / 7e11, p.bytes / local_hw.mem_bandwidth)
    dense = mm.theory(spec, wl, local_hw, "fp32", 1e-3, [1e-3])
    assert dense.bytes == sum(o.bytes for o in ops) and dense.format == "dense fp32"


def test_amx_steps_are_dense_at_the_hardware_peak_and_say_so(tiny_dir, local_hw):
    """Steps between the quantized crossover and amx_max_tokens read the dense weights at the
    hardware's peak, labelled as served on the AMX GEMM; above amx_max_tokens: plain dense."""
    import types

    import torch
    from sloserve.tools import roofline_measure as mm
    spec = get_model(tiny_dir)
    from sloserve.model.layers.linear import LinearPolicy
    model = _fake_model(LinearPolicy(quant_max_tokens=0, amx_max_tokens=64), None,
                        torch.bfloat16)
    eng = types.SimpleNamespace(runner=types.SimpleNamespace(model=model))
    a = mm.served_format(eng, 64, {})
    assert a.name == "dense bfloat16, AMX" and a.weight_bytes is None
    assert mm.served_format(eng, 65, {}) is None
    wl = Workload("prefill", 1, 64, "fp32", "fp32", "fp32")
    p = mm.theory(spec, wl, local_hw, "fp32", 1e-3, [1e-3], None, a)
    dense = mm.theory(spec, wl, local_hw, "fp32", 1e-3, [1e-3])
    assert p.format == "dense bfloat16, AMX" and (p.bytes, p.peak, p.bound_s) == \
        (dense.bytes, dense.peak, dense.bound_s)
