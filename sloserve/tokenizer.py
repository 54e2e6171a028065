"""Tokenizer: a thin wrapper over a transformers fast tokenizer (from an HF folder or a GGUF file).

Everything runs offline: ``HF_HUB_OFFLINE=1`` is set (if unset) before transformers is imported and
every ``from_pretrained`` call passes ``local_files_only=True``.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

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

        Uses ``PreTrainedTokenizerFast.from_pretrained(dir, gguf_file=name)`` (not ``AutoTokenizer``,
        which also parses the whole file for a config through the slow ``gguf.GGUFReader``).

        Args:
            gguf_path: path of the ``.gguf`` file.
            extra_eos_token_ids: eos ids from the model config.
            chat_template: ``tokenizer.chat_template`` metadata, installed if transformers did not.
        """
        from transformers import PreTrainedTokenizerFast

        folder, fname = os.path.split(os.path.abspath(gguf_path))
        hf = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=fname, local_files_only=True)
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

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text (see :meth:`apply_chat_template`).

        Raises:
            ValueError: the model has no chat template.
        """
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain completion "
                             "prompt instead, or use a model that ships tokenizer.chat_template")
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template and
        tokenize without adding special tokens again (the template writes them itself).

        Args:
            messages: OpenAI-style chat messages.
            add_generation_prompt: end with the assistant header (e.g. ``<|im_start|>assistant\\n``).

        Returns:
            Prompt token ids.

        Raises:
            ValueError: the model has no chat template.
        """
        text = self.render_chat_template(messages, add_generation_prompt=add_generation_prompt)
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
