"""Bad weight files are one ValueError naming the file and what is wrong with it: truncated (where
the file ends) or corrupt GGUF and safetensors files, unsupported GGUF tensor types, config.json
files that are not JSON, miss keys or name an unsupported architecture. The front end's
tokenizer load (``load_model_tokenizer``) refuses them with the same message as the weights'
loader. Every file here is a tiny one written in tmp_path (no tokenizer, so only the seams that
need none load it)."""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
import torch

from sloserve.gguf_file import gguf_problem, gguf_version
from sloserve.model import hf_loader
from sloserve.model.config import ModelConfig
from sloserve.model.loader import dummy_state_dict, load_model_tokenizer, load_weights

_SHAPES = {"token_embd.weight": (16, 32), "blk.0.attn_norm.weight": (32,),
           "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (16, 32),
           "blk.0.attn_v.weight": (16, 32), "blk.0.attn_output.weight": (32, 32),
           "blk.0.ffn_norm.weight": (32,), "blk.0.ffn_gate.weight": (64, 32),
           "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64),
           "output_norm.weight": (32,)}


def write_tiny_gguf(path, big_endian: bool = False, head_count=2) -> str:
    """A 1-layer llama GGUF (F32, vocab 16, hidden 32, tied, no tokenizer) that loads."""
    import gguf

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    if isinstance(head_count, list):
        w.add_array("llama.attention.head_count", head_count)
    else:
        w.add_head_count(head_count)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(16)
    rng = np.random.default_rng(0)
    for name, shape in _SHAPES.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _layout(path: str):
    """The reader's view of a sound file: where its fields and tensors are."""
    import gguf
    return gguf.GGUFReader(path)


def _variant(tmp_path, src: str, edit, name: str = "bad.gguf") -> str:
    data = bytearray(open(src, "rb").read())
    edited = edit(data)  # a new buffer, or None when edited in place
    data = data if edited is None else edited
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return str(out)


def _refused(path: str, **kw) -> str:
    with pytest.raises(ValueError) as e:
        load_weights(path, "float32", with_tokenizer=False, **kw)
    return str(e.value)


# ------------------------------------------------------------------------------------ GGUF

def test_the_tiny_gguf_and_the_embedded_model_are_sound(tiny_gguf, gguf_path):
    """The walker agrees with the reader on sound files (else it would blame good ones)."""
    assert gguf_problem(tiny_gguf) is None and gguf_problem(gguf_path) is None
    lw = load_weights(tiny_gguf, "float32", with_tokenizer=False)
    assert lw.config.num_hidden_layers == 1 and lw.config.head_dim == 16


def test_truncated_gguf_says_where_it_ends(tiny_gguf, tmp_path):
    r = _layout(tiny_gguf)
    arch = r.fields["general.architecture"]
    in_value = arch.offset + 8 + len("general.architecture") + 4 + 3  # inside its length
    first = r.tensors[0].field
    in_tensor_table = first.offset + 8 + 2  # inside the first tensor's name
    end, last = max((t.data_offset + t.n_bytes, t.name) for t in r.tensors)
    n_kv, n_t = len(r.fields) - 3, len(r.tensors)
    cases = {
        0: "the file is empty (0 bytes)",
        3: "truncated: the file ends at byte 3, inside the 24-byte header",
        20: "truncated: the file ends at byte 20, inside the header",
        in_value: f"truncated: the file ends at byte {in_value}, inside the value of metadata "
                  f"key 'general.architecture'",
        in_tensor_table: f"truncated: the file ends at byte {in_tensor_table}, inside the name "
                         f"of tensor 1 of {n_t}",
        end - 10: f"truncated: tensor data runs to byte {end} (tensor {last!r}), but the file "
                  f"ends at byte {end - 10}",
    }
    assert n_kv > 1
    for cut, problem in cases.items():
        p = _variant(tmp_path, tiny_gguf, lambda d: d[:cut], f"cut{cut}.gguf")
        assert _refused(p) == f"{p} is not a readable GGUF file: {problem}", cut
        assert gguf_problem(p) == problem


def test_the_header_reader_reads_what_gguf_reader_reads(tiny_gguf, gguf_path):
    """Metadata, the tensor table and each tensor's bytes as ``gguf.GGUFReader`` has them."""
    from sloserve.model.gguf_loader import read_gguf
    for path in (tiny_gguf, gguf_path):
        r, gf = _layout(path), read_gguf(path)
        ref = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
        assert gf.metadata == ref
        assert list(gf.tensors) == [t.name for t in r.tensors]
        for t in r.tensors:
            info = gf.tensors[t.name]
            assert (info.shape, info.ggml_type, info.offset, info.nbytes) == (
                tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type),
                int(t.data_offset), int(t.n_bytes))
            assert gf.raw(t.name).tobytes() == np.asarray(t.data).tobytes()


def test_a_big_endian_gguf_is_walked_in_its_byte_order(tmp_path, tiny_gguf):
    p = write_tiny_gguf(tmp_path / "be.gguf", big_endian=True)
    assert gguf_problem(p) is None
    from sloserve.model.gguf_loader import read_gguf
    be, le = read_gguf(p), read_gguf(tiny_gguf)
    assert be.byte_order == ">" and be.metadata == le.metadata
    for name in le.tensors:  # the same float32 values, swapped on read
        assert torch.equal(be.dequantize(name), le.dequantize(name)), name
    end, last = max((t.data_offset + t.n_bytes, t.name) for t in _layout(p).tensors)
    cut = _variant(tmp_path, p, lambda d: d[:end - 10], "be-cut.gguf")
    assert gguf_problem(cut) == (f"truncated: tensor data runs to byte {end} (tensor {last!r}), "
                                 f"but the file ends at byte {end - 10}")


def test_corrupt_gguf_says_which_field(tiny_gguf, tmp_path):
    r = _layout(tiny_gguf)
    n_kv = len(r.fields) - 3
    key_at = r.fields["general.architecture"].offset  # the first metadata key
    type_at = key_at + 8 + len("general.architecture")

    def put(at, fmt, v):
        def edit(d):
            struct.pack_into(fmt, d, at, v)
        return edit

    def bad_utf8(d):
        d[key_at + 8] = 0xFF

    cases = [
        (put(16, "<Q", 2 ** 40), "corrupt: the header claims 1099511627776 metadata keys"),
        (put(8, "<Q", 2 ** 40), "corrupt: the header claims 1099511627776 tensors"),
        (put(4, "<I", 99), "unsupported GGUF version 99 (supported: 2, 3)"),
        (bad_utf8, f"corrupt: the name of metadata key 1 of {n_kv} (at byte {key_at + 8}) is "
                   f"not UTF-8 text"),
        (put(type_at, "<I", 77), "corrupt: the value of metadata key 'general.architecture' "
                                 "has an unknown value type 77"),
        (put(key_at, "<Q", 2 ** 40), f"corrupt: the name of metadata key 1 of {n_kv} claims "
                                     f"1099511627776 bytes"),
        (put(0, "<I", 0x45504F4E), "it does not start with the GGUF magic bytes "
                                   "(found b'NOPE')"),
    ]
    for i, (edit, problem) in enumerate(cases):
        p = _variant(tmp_path, tiny_gguf, edit, f"bad{i}.gguf")
        assert _refused(p) == f"{p} is not a readable GGUF file: {problem}"


def _type_at(r, name: str) -> int:
    t = next(t for t in r.tensors if t.name == name)
    return t.field.offset + 8 + len(name) + 4 + 8 * len(t.shape)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_unsupported_gguf_tensor_types_are_named(tiny_gguf, tmp_path, quantization):
    """An unknown type id (a newer llama.cpp) is refused by the reader; a known type gguf cannot
    dequantize (Q8_1, I8) by the loader: both name the tensor and the type."""
    at = _type_at(_layout(tiny_gguf), "blk.0.attn_q.weight")
    p = _variant(tmp_path, tiny_gguf, lambda d: struct.pack_into("<I", d, at, 99), "t99.gguf")
    assert _refused(p, quantization=quantization) == (
        f"{p} is not a readable GGUF file: unsupported quantization type: tensor "
        f"'blk.0.attn_q.weight' is stored as GGML type 99, which gguf {gguf_version()} does not "
        f"know")
    for code, tname in ((9, "Q8_1"), (24, "I8")):
        p = _variant(tmp_path, tiny_gguf, lambda d: struct.pack_into("<I", d, at, code),
                     f"{tname}.gguf")
        assert _refused(p, quantization=quantization).startswith(
            f"{p}: tensor 'blk.0.attn_q.weight' is stored as {tname}, an unsupported "
            f"quantization type (gguf {gguf_version()} cannot dequantize it: ")


def test_gguf_metadata_of_the_wrong_type_names_the_file(tmp_path):
    p = write_tiny_gguf(tmp_path / "list.gguf", head_count=[2, 2])
    msg = _refused(p)
    assert msg.startswith(f"{p}: corrupt GGUF metadata (TypeError: ")
    p = write_tiny_gguf(tmp_path / "zero.gguf", head_count=0)
    assert _refused(p).startswith(f"{p}: corrupt GGUF metadata (ZeroDivisionError")


def test_the_front_end_refuses_a_bad_gguf_with_the_loaders_message(tiny_gguf, tmp_path):
    p = _variant(tmp_path, tiny_gguf, lambda d: d[:20], "cut.gguf")
    with pytest.raises(ValueError) as e:
        load_model_tokenizer(p)
    assert str(e.value) == (f"{p} is not a readable GGUF file: truncated: the file ends at "
                            f"byte 20, inside the header")
    with pytest.raises(ValueError) as e:  # sound, but no tokenizer in it
        load_model_tokenizer(tiny_gguf)
    assert str(e.value) == f"{tiny_gguf} carries no tokenizer (tokenizer.ggml.tokens missing)"


# ------------------------------------------------------------------------ safetensors / config

TINY_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16,
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
            "tie_word_embeddings": True}


@pytest.fixture
def tiny_hf(tmp_path) -> str:
    """A folder with config.json and model.safetensors (no tokenizer files)."""
    from safetensors.torch import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CFG))
    save_file(dummy_state_dict(ModelConfig.from_hf_dict(TINY_CFG)), str(folder / "model.safetensors"))
    return str(folder)


def test_the_tiny_folder_loads_its_weights(tiny_hf):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):  # checked after the weights
        load_weights(tiny_hf, "float32", with_tokenizer=False)
    assert hf_loader.safetensors_problem(os.path.join(tiny_hf, "model.safetensors")) is None


def test_truncated_or_corrupt_safetensors_say_what(tiny_hf):
    st = os.path.join(tiny_hf, "model.safetensors")
    data = open(st, "rb").read()
    size, n = len(data), int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    end, last = max((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")
    cases = [
        (b"", "truncated: the file ends at byte 0, inside the 8-byte header length"),
        (data[:5], "truncated: the file ends at byte 5, inside the 8-byte header length"),
        (data[:8 + n // 2], f"truncated: the file ends at byte {8 + n // 2}, inside its {n}-byte "
                            f"JSON header"),
        (data[:size - 3], f"truncated: tensor data runs to byte {8 + n + end} (tensor {last!r}), "
                          f"but the file ends at byte {size - 3}"),
        (struct.pack("<Q", 2 ** 50) + data[8:], "corrupt: its header length is "
                                                "1125899906842624 bytes"),
        (data[:8] + b"{" * n + data[8 + n:], "corrupt: its header is not valid JSON (Expecting "
                                             "property name enclosed in double quotes: line 1 "
                                             "column 2 (char 1))"),
    ]
    for bad, problem in cases:
        open(st, "wb").write(bad)
        with pytest.raises(ValueError) as e:
            load_weights(tiny_hf, "float32", with_tokenizer=False)
        assert str(e.value) == f"{st} is not a readable safetensors file: {problem}"


def test_a_bad_safetensors_index_names_itself(tiny_hf):
    index = os.path.join(tiny_hf, "model.safetensors.index.json")
    open(index, "w").write("{")
    with pytest.raises(ValueError, match=f"^{re.escape(index)} is not a valid safetensors "
                                         f"index: JSONDecodeError: "):
        load_weights(tiny_hf, "float32", with_tokenizer=False)
    json.dump({"weight_map": {"model.norm.weight": "model-00002.safetensors"}}, open(index, "w"))
    with pytest.raises(FileNotFoundError) as e:
        load_weights(tiny_hf, "float32", with_tokenizer=False)
    assert str(e.value) == f"{index} names model-00002.safetensors, which is not in {tiny_hf}"


SUPPORTED = ("supported: model_type llama, mistral, qwen2 (LlamaForCausalLM, MistralForCausalLM, "
             "Qwen2ForCausalLM)")
_NO_MT = {k: v for k, v in TINY_CFG.items() if k != "model_type"}


@pytest.mark.parametrize("text,problem", [
    (json.dumps({k: v for k, v in TINY_CFG.items() if k not in ("hidden_size", "num_hidden_layers")}),
     ": model config: missing hidden_size, num_hidden_layers"),
    ("{not json", " is not a valid config.json: Expecting property name enclosed in double "
                  "quotes: line 1 column 2 (char 1)"),
    ("[1, 2]", ": model config: expected a JSON object, got list"),
    (json.dumps({**TINY_CFG, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}),
     f": unsupported model_type 'gpt2' (GPT2LMHeadModel); {SUPPORTED}"),
    (json.dumps({**_NO_MT, "architectures": ["GPT2LMHeadModel"]}),
     f": unsupported architecture GPT2LMHeadModel (no model_type); {SUPPORTED}"),
    (json.dumps({**TINY_CFG, "architectures": ["LlamaForSequenceClassification"]}),
     f": unsupported architecture LlamaForSequenceClassification (model_type 'llama'); "
     f"{SUPPORTED}"),
    (json.dumps({**TINY_CFG, "hidden_size": "32"}),
     ": model config: hidden_size and num_attention_heads must be positive integers, got '32' "
     "and 2"),
    (json.dumps({**TINY_CFG, "rms_norm_eps": "1e-5"}),
     ": model config: rms_norm_eps must be a number, got '1e-5'"),
], ids=["missing-keys", "not-json", "not-an-object", "gpt2", "gpt2-architecture-only",
        "not-a-causal-lm", "hidden-size-a-string", "eps-a-string"])
def test_bad_config_json_is_named_by_the_loader_and_the_front_end(tiny_hf, text, problem):
    cfg = os.path.join(tiny_hf, "config.json")
    open(cfg, "w").write(text)
    for load in (lambda: load_weights(tiny_hf, "float32", with_tokenizer=False),
                 lambda: load_weights(tiny_hf, "float32", load_format="dummy"),
                 lambda: load_model_tokenizer(tiny_hf),
                 lambda: load_model_tokenizer(tiny_hf, "dummy")):
        with pytest.raises(ValueError) as e:
            load()
        assert str(e.value) == cfg + problem


def test_a_config_json_that_is_not_utf8_is_named(tiny_hf):
    cfg = os.path.join(tiny_hf, "config.json")
    open(cfg, "wb").write('{"model_type": "llama", "name": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=f"^{re.escape(cfg)} is not a valid config.json: "
                                         f"'utf-8' codec can't decode byte 0xe9"):
        load_model_tokenizer(tiny_hf)
