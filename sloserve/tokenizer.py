"""Tokenizer: a thin wrapper over a transformers fast tokenizer (from an HF folder or a GGUF file),
and :func:`load_model_tokenizer`, the tokenizer of a model path as the API process loads it.

Nothing here imports torch (the API process must not; ``tests/test_layers.py`` checks it): a
GGUF's metadata is read by :func:`read_gguf_metadata`, not by transformers' GGUF reader, which
imports torch. Everything runs offline: ``HF_HUB_OFFLINE=1`` is set (if unset) before
transformers is imported and every ``from_pretrained`` call passes ``local_files_only=True``.
"""
from __future__ import annotations

import glob
import os
from typing import Any, Iterable

from sloserve.config import LOAD_FORMAT_CHOICES
from sloserve.embedded import default_model_path
from sloserve.gguf_file import read_gguf_header

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _dedup(ids: Iterable[int | None]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) >= 0 and int(i) not in out:
            out.append(int(i))
    return out


class Tokenizer:
    """Thin wrapper over a transformers ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in v5).

    Attributes:
        hf: the wrapped transformers tokenizer (use it for anything not wrapped here).
        eos_token_ids: every id that ends generation: ``extra_eos_token_ids`` (the model config's /
            generation_config's eos) followed by the tokenizer's own eos, deduplicated, in that order.
        bos_token_id: the tokenizer's bos id (None if it has none).
        vocab_size: ids the tokenizer can produce, added tokens included (``len(hf)``); may be
            smaller than the model's embedding rows.
        chat_template: Jinja chat template, or None.
    """

    def __init__(self, hf: Any, extra_eos_token_ids: Iterable[int] = (), chat_template: str | None = None):
        """Wrap ``hf``.

        Args:
            hf: a transformers tokenizer.
            extra_eos_token_ids: eos ids from the model config / generation config.
            chat_template: template to install when ``hf`` has none (e.g. from GGUF metadata).
        """
        self.hf = hf
        if chat_template and not getattr(hf, "chat_template", None):
            hf.chat_template = chat_template
        self.eos_token_ids: list[int] = _dedup([*extra_eos_token_ids, getattr(hf, "eos_token_id", None)])
        self.bos_token_id: int | None = getattr(hf, "bos_token_id", None)
        self.vocab_size: int = len(hf)

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def from_pretrained(cls, folder: str, extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """Load ``tokenizer.json`` / ``tokenizer_config.json`` from a local Hugging Face folder.

        Raises:
            OSError / ValueError: from transformers when the folder holds no usable tokenizer.
        """
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return cls(hf, extra_eos_token_ids)

    @classmethod
    def from_gguf(cls, gguf_path: str, extra_eos_token_ids: Iterable[int] = (),
                  chat_template: str | None = None) -> "Tokenizer":
        """Build from a GGUF file's ``tokenizer.*`` metadata with transformers' GGUF conversion.

        Builds what ``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)`` builds,
        with the metadata read here (see :func:`_hf_tokenizer_from_gguf`).

        Args:
            gguf_path: path of the ``.gguf`` file.
            extra_eos_token_ids: eos ids from the model config.
            chat_template: ``tokenizer.chat_template`` metadata, installed if transformers did not.

        Raises:
            NoTokenizerError: a GGUF without ``tokenizer.*`` metadata.
            ValueError / KeyError / OSError: the file is no GGUF, is truncated (a
                :class:`~sloserve.gguf_file.GGUFError` saying where), or carries a tokenizer
                transformers cannot convert.
        """
        hf = _hf_tokenizer_from_gguf(os.path.abspath(gguf_path))
        return cls(hf, extra_eos_token_ids, chat_template=chat_template)

    # ------------------------------------------------------------------------------------- API
    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None if the model has none."""
        return getattr(self.hf, "chat_template", None) or None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: input string.
            add_special_tokens: add the tokenizer's bos/eos decorations (if it has any). Special
                tokens written literally in ``text`` (e.g. ``<|im_start|>``) always map to their id.
        """
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ints in ``[0, vocab_size)``)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                             tools: list[dict] | None = None,
                             chat_template: str | None = None) -> str:
        """The chat prompt as text (see :meth:`apply_chat_template`).

        Raises:
            ValueError: the model has no chat template (and none is given).
        """
        if not (chat_template or self.chat_template):
            raise ValueError("this model's tokenizer has no chat template; send a plain completion "
                             "prompt instead, or use a model that ships tokenizer.chat_template")
        return self.hf.apply_chat_template(messages, tokenize=False, tools=tools,
                                           chat_template=chat_template,
                                           add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            chat_template: str | None = None) -> list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template and
        tokenize without adding special tokens again (the template writes them itself).

        Args:
            messages: OpenAI-style chat messages.
            add_generation_prompt: end with the assistant header (e.g. ``<|im_start|>assistant\\n``).
            tools: OpenAI-style tools for the template (``tools`` in its namespace).
            chat_template: a template to use instead of the model's (``--chat-template``).

        Returns:
            Prompt token ids.

        Raises:
            ValueError: the model has no chat template.
        """
        text = self.render_chat_template(messages, add_generation_prompt, tools, chat_template)
        return self.encode(text, add_special_tokens=False)

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_ids})")


def load_tokenizer(path: str) -> Tokenizer:
    """A tokenizer from a GGUF file or a Hugging Face folder (``tokenizer.json`` etc.).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no tokenizer can be loaded from it (first line of the reason).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    try:
        if os.path.isfile(path) and path.endswith(".gguf"):
            return Tokenizer.from_gguf(path)
        return Tokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot load a tokenizer from {path!r} (a GGUF file or a folder with "
                         f"tokenizer.json is needed): {first}") from None


# ------------------------------------------------------------------------------ GGUF metadata
def read_gguf_metadata(path: str) -> dict[str, Any]:
    """A GGUF file's metadata (``{key: value}``: numbers, bools, strings, and lists of them),
    read from the header alone (:func:`sloserve.gguf_file.read_gguf_header`; no tensor is
    touched; the values transformers' own GGUF reader returns for the same keys).

    Raises:
        sloserve.gguf_file.GGUFError (a ValueError): not a GGUF file, an unknown version, a
            truncated or corrupt header; OSError: an unreadable file.
    """
    return read_gguf_header(path, tensors=False).metadata


class NoTokenizerError(ValueError):
    """A sound GGUF file without ``tokenizer.*`` metadata."""


#: transformers' special-token kwargs and the GGUF ``tokenizer.ggml.*`` id keys that give them
_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _hf_tokenizer_from_gguf(path: str) -> Any:
    """The transformers tokenizer that ``PreTrainedTokenizerFast.from_pretrained(dir,
    gguf_file=name)`` builds (its ``get_gguf_tokenizer`` with the metadata read by
    :func:`read_gguf_metadata`, then its ``convert_gguf_tokenizer``): transformers' GGUF reader
    imports torch, its conversion does not."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    md = read_gguf_metadata(path)
    if "tokenizer.ggml.tokens" not in md:
        raise NoTokenizerError(f"{path} carries no tokenizer (tokenizer.ggml.tokens missing)")
    grouped = {group: {name: md[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in md}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    kind = tokenizer.get("tokenizer_type")
    if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that says nothing
        config.setdefault("add_bos_token", True)
    elif kind == "gemma4":  # its chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = md.get(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(md["general.architecture"], tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


# ------------------------------------------------------------------------------ a model's tokenizer
#: files that hold a Hugging Face folder's tokenizer (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(folder: str) -> bool:
    """True if ``folder`` holds any of ``tokenizer.json``, ``tokenizer_config.json``,
    ``tokenizer.model``, ``vocab.json``."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def detect_format(path: str) -> str:
    """``"gguf"`` or ``"hf"``: the load format ``auto`` means for an existing ``path``.

    Raises:
        ValueError: a file that is no GGUF, or a folder with neither config.json / *.safetensors
            nor exactly one .gguf file.
    """
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return "gguf"
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ValueError(f"cannot infer the load format of file {path}: expected a .gguf file or a "
                         "Hugging Face folder (pass load_format='dummy' for a config.json)")
    if glob.glob(os.path.join(path, "*.safetensors")) or os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    if len(ggufs) == 1:
        return "gguf"
    raise ValueError(f"cannot infer the load format of folder {path}: no config.json/*.safetensors "
                     f"and {len(ggufs)} .gguf files")


def resolve_model_source(path: str | os.PathLike | None, load_format: str = "auto"
                         ) -> tuple[str, str]:
    """(absolute path, load format) of the model at ``path`` (None: the embedded model), the
    format ``auto`` resolved: what the weights' loader and the tokenizer's both start from.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: an unknown load format, or one ``auto`` cannot infer.
    """
    if load_format not in LOAD_FORMAT_CHOICES:
        raise ValueError(f"unknown load_format {load_format!r}; allowed: {', '.join(LOAD_FORMAT_CHOICES)}")
    source = os.path.abspath(os.path.expanduser(os.fspath(path))) if path else default_model_path()
    if not os.path.exists(source):
        raise FileNotFoundError(f"model path does not exist: {source}")
    return source, detect_format(source) if load_format == "auto" else load_format


def single_gguf(path: str) -> str:
    """The .gguf file ``path`` names: itself, or a folder's only one.

    Raises:
        ValueError: a folder holding no or several .gguf files.
    """
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) != 1:
            raise ValueError(f"load_format='gguf' needs a .gguf file; folder {path} holds {len(ggufs)}")
        return ggufs[0]
    return path


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def load_model_tokenizer(path: str | None, load_format: str = "auto") -> Tokenizer | None:
    """The tokenizer of the model at ``path`` (None: the embedded GGUF) without reading its
    weights or importing torch (what the API process loads while the engine core loads the
    weights): from a GGUF's metadata, or a folder's tokenizer files; None for a dummy model
    without tokenizer files.

    It checks no more of the model than the tokenizer needs:
    :func:`sloserve.model.loader.load_model_tokenizer` also checks config.json and the GGUF file
    the way the weights' loader does, with its messages.

    Raises:
        FileNotFoundError: the path (or a folder's tokenizer files) does not exist.
        ValueError: unknown load format, a file or folder of no known format, or no tokenizer
            can be built from it (every message names the file).
    """
    source, fmt = resolve_model_source(path, load_format)
    if fmt == "gguf":
        gguf_path = single_gguf(source)
        try:
            return Tokenizer.from_gguf(gguf_path)
        except NoTokenizerError:
            raise
        except Exception as e:  # a bad file (GGUFError: where), transformers' own errors
            raise ValueError(f"cannot build the tokenizer of {gguf_path}: {_first_line(e)}") from e
    folder = source if os.path.isdir(source) else os.path.dirname(source)
    if not has_tokenizer_files(folder):
        if fmt == "dummy":
            return None
        raise FileNotFoundError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {folder}")
    try:
        return Tokenizer.from_pretrained(folder)
    except Exception as e:  # transformers raises OSError/ValueError/TypeError/its own errors
        raise ValueError(f"cannot load the tokenizer in {folder}: {_first_line(e)}") from e
