"""`sloserve serve --model BAD` (and `generate`, `profile`, which load weights in-process): one
error line naming the file and what is wrong with it, exit code 2, no traceback, whichever
process notices first (the front end loading the tokenizer, or the engine core loading the
weights). The messages themselves are pinned in tests/model/test_bad_weights.py; here the
path through the processes to the terminal."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest

from sloserve.gguf_file import gguf_problem, gguf_version
from sloserve.model.hf_loader import safetensors_problem

CLI = [sys.executable, "-m", "sloserve.cli"]
SERVE_FLAGS = ["--port", "0", "--dtype", "float32", "--num-kv-blocks", "64", "--log-level",
               "warning"]


def _run(*args: str, timeout: float = 120) -> tuple[int, list[str], str]:
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    return p.returncode, lines, p.stderr


def _bad_gguf(src: str, dst, edit) -> str:
    data = bytearray(open(src, "rb").read())
    edited = edit(data)  # a new buffer, or None when edited in place
    data = data if edited is None else edited
    dst.write_bytes(bytes(data))
    return str(dst)


def _attn_q_type_offset(path: str) -> int:
    import gguf
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    return t.field.offset + 8 + len(t.name) + 4 + 8 * len(t.shape)


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, gguf_path, tiny_llama_dir) -> dict[str, tuple[str, str]]:
    """name -> (model path, the one error line `sloserve serve` must print)."""
    d = tmp_path_factory.mktemp("bad-models")
    out: dict[str, tuple[str, str]] = {}
    p = _bad_gguf(gguf_path, d / "cut.gguf", lambda b: b[:4096])
    assert gguf_problem(p).startswith("truncated: the file ends at byte 4096, inside ")
    out["gguf-truncated"] = (p, f"{p} is not a readable GGUF file: {gguf_problem(p)}")
    p = _bad_gguf(gguf_path, d / "kv.gguf", lambda b: struct.pack_into("<Q", b, 16, 2 ** 40))
    out["gguf-corrupt"] = (p, f"{p} is not a readable GGUF file: corrupt: the header claims "
                              f"1099511627776 metadata keys")
    at = _attn_q_type_offset(gguf_path)
    p = _bad_gguf(gguf_path, d / "t99.gguf", lambda b: struct.pack_into("<I", b, at, 99))
    out["gguf-unsupported-type"] = (p, f"{p} is not a readable GGUF file: unsupported "
                                       f"quantization type: tensor 'blk.0.attn_q.weight' is "
                                       f"stored as GGML type 99, which gguf {gguf_version()} "
                                       f"does not know")
    hf = d / "st-truncated"
    shutil.copytree(tiny_llama_dir, hf)
    st = hf / "model.safetensors"
    st.write_bytes(st.read_bytes()[:os.path.getsize(st) // 2])
    assert safetensors_problem(str(st)).startswith("truncated: tensor data runs to byte ")
    out["safetensors-truncated"] = (str(hf), f"{st} is not a readable safetensors file: "
                                             f"{safetensors_problem(str(st))}")
    cfg = json.loads((hf / "config.json").read_text())
    for name, text, problem in (
            ("config-missing-keys",
             json.dumps({k: v for k, v in cfg.items() if k not in ("hidden_size", "vocab_size")}),
             ": model config: missing vocab_size, hidden_size"),
            ("config-not-json", '{"model_type": "llama",',
             " is not a valid config.json: Expecting property name enclosed in double quotes: "
             "line 1 column 24 (char 23)"),
            ("config-gpt2", json.dumps({**cfg, "model_type": "gpt2",
                                        "architectures": ["GPT2LMHeadModel"]}),
             ": unsupported model_type 'gpt2' (GPT2LMHeadModel); supported: model_type llama, "
             "mistral, qwen2 (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")):
        folder = d / name  # the tokenizer files stay: only the config is wrong
        shutil.copytree(tiny_llama_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        (folder / "config.json").write_text(text)
        out[name] = (str(folder), f"{folder / 'config.json'}{problem}")
    return out


@pytest.mark.parametrize("name", ["gguf-truncated", "gguf-corrupt", "gguf-unsupported-type",
                                  "safetensors-truncated", "config-missing-keys",
                                  "config-not-json", "config-gpt2"])
def test_serve_a_bad_model_is_one_line_and_exit_2(bad_models, name):
    path, line = bad_models[name]
    rc, lines, stderr = _run("serve", "--model", path, *SERVE_FLAGS)
    assert rc == 2, stderr
    assert lines == [f"sloserve: error: {line}"], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("cmd", [["generate", "hi", "--max-tokens", "1"], ["profile"]])
def test_generate_and_profile_refuse_a_bad_model_the_same_way(bad_models, cmd, tmp_path):
    path, line = bad_models["safetensors-truncated"]
    rc, lines, stderr = _run(*cmd, "--model", path, "--dtype", "float32", "--num-kv-blocks", "64",
                             *(["--out", str(tmp_path / "p.json")] if cmd == ["profile"] else []))
    assert rc == 2, stderr
    prog = "sloserve profile" if cmd == ["profile"] else "sloserve"
    assert lines == [f"{prog}: error: {line}"], stderr
    assert "Traceback" not in stderr and not (tmp_path / "p.json").exists()
