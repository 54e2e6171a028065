"""The CLI entry point: table, JSON, textbook, errors."""
import json

import pytest

from sloserve.roofline.cli import main


def test_table_output_has_units(capsys):
    assert main(["--model", "Llama-3-70B", "--hardware", "H100-SXM", "--tp", "8", "--batch", "128",
                 "--context-len", "4096", "--weight-dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "balance point: 295.2 FLOP/byte" in out
    assert "160.00 GiB (171.80 GB) total, 20.00 GiB (21.47 GB) per GPU (TP=8)" in out
    for op in ("qkv_proj", "attention", "o_proj", "mlp", "lm_head"):
        assert op in out
    assert "tokens/s" in out and "max batch" in out and "layer-wise pipelined" in out


def test_json_output(capsys):
    assert main(["--model", "DeepSeek-V3", "--hardware", "H200-SXM", "--weight-dtype", "fp8",
                 "--kv-dtype", "bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["kv_bytes_per_token"]["bf16"] == 70_272
    assert d["model"]["attention_kind"] == "MLA"
    assert d["decode"]["total"]["bound"] == "memory"
    assert set(d["transfers"]) == {"nic-400g", "nvlink"}


def test_textbook(capsys):
    assert main(["--textbook"]) == 0
    out = capsys.readouterr().out
    assert "295.224 FLOP/byte" in out and "10.00 GiB = 10.74 GB" in out and "14.543 ms" in out
    assert main(["--textbook", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["lecture_table"]) == 7


def test_errors(capsys):
    assert main(["--model", "nope"]) == 2
    assert "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--batch", "0"])
    with pytest.raises(SystemExit):
        main(["--memory-efficiency", "1.5"])


def test_no_torch_import():
    import subprocess
    import sys

    code = ("import sys, sloserve.roofline.cli as c; c.main(['--textbook']); "
            "c.main(['--model', 'SmolLM2-135M']); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_sloserve_roofline_subcommand_dispatches(capsys):
    """`sloserve roofline ...` hands every flag to the roofline parser."""
    from sloserve.cli import main
    assert main(["roofline", "--model", "Llama-3-8B", "--hardware", "H100-SXM", "--json"]) == 0
    assert '"balance": 295.22388' in capsys.readouterr().out
