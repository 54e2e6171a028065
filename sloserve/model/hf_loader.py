"""Load a local Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer files)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from sloserve.model.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_hf_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Read ``config.json`` (``path`` is the folder or the file itself) and, next to it,
    ``generation_config.json``; eos ids are the union of both (config first).

    Returns:
        ``(ModelConfig, raw config dict)``.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: invalid JSON or an unsupported architecture.
    """
    cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        with open(cfg_file) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not a valid config.json: {e}") from e
    config = ModelConfig.from_hf_dict(raw)
    gen_file = os.path.join(os.path.dirname(cfg_file), "generation_config.json")
    if os.path.isfile(gen_file):
        try:
            with open(gen_file) as f:
                gen = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError):
            gen = {}
        eos = gen.get("eos_token_id")
        for e in ([eos] if isinstance(eos, int) else (eos or [])):
            if e not in config.eos_token_ids:
                config.eos_token_ids.append(int(e))
        if config.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            config.bos_token_id = gen["bos_token_id"]
    return config, raw


def has_tokenizer_files(folder: str) -> bool:
    """True if ``folder`` holds any of ``tokenizer.json``, ``tokenizer_config.json``,
    ``tokenizer.model``, ``vocab.json``."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` shards (from ``model.safetensors.index.json`` when present,
    else every ``*.safetensors`` in the folder), sorted.

    Raises:
        FileNotFoundError: none found (the message says if only ``.bin`` / ``.gguf`` files exist).
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, x) for x in files]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        others = [os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.bin"))
                  + glob.glob(os.path.join(folder, "*.gguf"))]
        hint = (f" (found {', '.join(sorted(others))}: only safetensors are supported for folders; "
                f"pass a .gguf file directly)" if others else "")
        raise FileNotFoundError(f"no *.safetensors weights in {folder}{hint}")
    return files


def load_hf_state_dict(folder: str, config: ModelConfig,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Load all safetensors shards of ``folder`` into one state dict cast to ``dtype``.

    Drops ``*.rotary_emb.inv_freq`` buffers and, when ``config.tie_word_embeddings``, ``lm_head.weight``.
    Names are left as Hugging Face wrote them (validation is the caller's job).
    """
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        for k, v in load_file(f).items():
            if k.endswith("rotary_emb.inv_freq"):
                continue
            if k == "lm_head.weight" and config.tie_word_embeddings:
                continue
            sd[k] = v if v.dtype == dtype else v.to(dtype)
    return sd


def hf_model_name(folder: str) -> str:
    """Served model name of a folder checkpoint: the folder's basename."""
    return os.path.basename(os.path.normpath(os.path.abspath(folder)))
