"""sloserve.tokenizer without torch: the GGUF tokenizer it builds is the one transformers'
``from_pretrained(dir, gguf_file=name)`` builds, its metadata reader reads what transformers'
reads, and ``load_model_tokenizer`` handles GGUF files, Hugging Face folders and dummy folders."""
from __future__ import annotations

import json
import os

import pytest

from sloserve.tokenizer import NoTokenizerError, Tokenizer, load_model_tokenizer, read_gguf_metadata

TEXTS = ["Hello, world!", "  two spaces and a tab\there", "caf\u00e9 \u00fcber \u4f60\u597d \U0001f600",
         "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x ** 2\n", ""]


def test_gguf_tokenizer_is_transformers_own(gguf_path):
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(gguf_path)
    ref = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name, local_files_only=True)
    tok = Tokenizer.from_gguf(gguf_path)
    hf = tok.hf
    assert json.loads(hf.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    assert hf.get_vocab() == ref.get_vocab() and len(hf) == len(ref) == tok.vocab_size
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "chat_template"):
        assert getattr(hf, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        ids = ref.encode(text)
        assert tok.encode(text) == ids
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=True,
                                                                    add_generation_prompt=True,
                                                                    return_dict=False)


def test_gguf_metadata_is_what_transformers_reads(gguf_path):
    from transformers.integrations.gguf.reader import read_gguf_metadata as transformers_read

    ref, _ = transformers_read(gguf_path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    md = read_gguf_metadata(gguf_path)
    assert md.keys() == ref.keys()
    for k, v in ref.items():  # transformers counts the string arrays it was not asked for
        assert md[k] == v or (isinstance(md[k], list) and v == len(md[k])), k
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and md["general.architecture"] == "llama"


def test_a_gguf_that_is_cut_or_carries_no_tokenizer_is_refused_by_name(gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(gguf_path, "rb").read(100_000))
    with pytest.raises(ValueError, match=f"^cannot build the tokenizer of {cut}: "):
        load_model_tokenizer(str(cut))
    import gguf

    bare = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(bare), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(NoTokenizerError, match=f"^{bare} carries no tokenizer"):
        load_model_tokenizer(str(bare))


def test_folders_hf_and_dummy(gguf_path, tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert load_model_tokenizer(str(folder), "dummy") is None  # a dummy model may have none
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_model_tokenizer(str(folder))
    Tokenizer.from_gguf(gguf_path).hf.save_pretrained(str(folder))
    tok = load_model_tokenizer(str(folder))
    assert tok.encode("Hello, world!") == Tokenizer.from_gguf(gguf_path).encode("Hello, world!")
    with pytest.raises(ValueError, match="unknown load_format 'pt'"):
        load_model_tokenizer(str(folder), "pt")
    with pytest.raises(FileNotFoundError, match="model path does not exist"):
        load_model_tokenizer(str(tmp_path / "nope"))
