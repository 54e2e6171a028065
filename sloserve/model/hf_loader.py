"""Load a local Hugging Face checkpoint folder (config.json + *.safetensors + tokenizer files)."""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from sloserve.model.config import ModelConfig
from sloserve.tokenizer import TOKENIZER_FILES, has_tokenizer_files  # noqa: F401 (the loader's)


def read_hf_config(path: str) -> tuple[ModelConfig, dict[str, Any]]:
    """Read ``config.json`` (``path`` is the folder or the file itself) and, next to it,
    ``generation_config.json``; eos ids are the union of both (config first).

    Returns:
        ``(ModelConfig, raw config dict)``.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: ``"{config.json's path}: ..."``: not JSON, not a JSON object, a required key
            missing or of the wrong type, or an unsupported architecture / model_type.
    """
    cfg_file = path if os.path.isfile(path) else os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not a valid config.json: {e}") from e
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from e
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


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's ``*.safetensors`` shards (from ``model.safetensors.index.json`` when present,
    else every ``*.safetensors`` in the folder), sorted.

    Raises:
        FileNotFoundError: none found (the message says if only ``.bin`` / ``.gguf`` files exist),
            or a shard the index names is missing.
        ValueError: the index is not JSON or has no ``weight_map`` of file names.
    """
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            if not all(isinstance(x, str) for x in files):
                raise TypeError("a weight_map value is not a file name")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: "
                             f"{type(e).__name__}: {e}") from e
        for x in files:
            if not os.path.isfile(os.path.join(folder, x)):
                raise FileNotFoundError(f"{index} names {x}, which is not in {folder}")
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

    Raises:
        FileNotFoundError / ValueError: as :func:`safetensors_files`.
        ValueError: ``"{shard} is not a readable safetensors file: ..."``: a truncated shard
            (where it ends) or a corrupt one (its header), see :func:`safetensors_problem`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in safetensors_files(folder):
        try:
            tensors = load_file(f)
        except SafetensorError as e:
            raise ValueError(f"{f} is not a readable safetensors file: "
                             f"{safetensors_problem(f) or e}") from e
        for k, v in tensors.items():
            if k.endswith("rotary_emb.inv_freq"):
                continue
            if k == "lm_head.weight" and config.tie_word_embeddings:
                continue
            sd[k] = v if v.dtype == dtype else v.to(dtype)
    return sd


def safetensors_problem(path: str) -> str | None:
    """What is wrong with a safetensors file that ``safetensors`` refused: an 8-byte header
    length, the JSON header, then the tensor data the header's ``data_offsets`` point into.

    Returns:
        ``"truncated: ..."`` (where the file ends and what it cuts short), ``"corrupt: ..."``
        (its header), or None if neither shows (safetensors' own message then says more).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated: the file ends at byte {size}, inside the 8-byte header length"
            n = int.from_bytes(head, "little")
            if n > 100_000_000:  # safetensors' own limit on the header
                return f"corrupt: its header length is {n} bytes"
            if 8 + n > size:
                return (f"truncated: the file ends at byte {size}, inside its {n}-byte JSON "
                        f"header")
            header = json.loads(f.read(n))
    except OSError:
        return None
    except (ValueError, UnicodeDecodeError) as e:
        return f"corrupt: its header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "corrupt: its header is not a JSON object"
    ends = [(int(v["data_offsets"][1]), k) for k, v in header.items()
            if isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    if ends and 8 + n + max(ends)[0] > size:
        end, name = max(ends)
        return (f"truncated: tensor data runs to byte {8 + n + end} (tensor {name!r}), but the "
                f"file ends at byte {size}")
    return None


def hf_model_name(folder: str) -> str:
    """Served model name of a folder checkpoint: the folder's basename."""
    return os.path.basename(os.path.normpath(os.path.abspath(folder)))
