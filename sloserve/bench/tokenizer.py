"""Finding the tokenizer a benchmark builds its prompts with."""
from __future__ import annotations

import os

import httpx

from sloserve.tokenizer import Tokenizer, load_tokenizer


def server_models(base_url: str, timeout_s: float = 10.0) -> list[dict]:
    """``GET /v1/models`` -> its ``data`` list.

    Raises:
        ConnectionError: the server cannot be reached or answers with an error status.
    """
    url = base_url.rstrip("/") + "/v1/models"
    try:
        r = httpx.get(url, timeout=timeout_s, trust_env=False)
        r.raise_for_status()
        body = r.json()
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:
        raise ConnectionError(f"cannot list models at {url}: {e}") from e
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                             for m in data):
        raise ConnectionError(f"{url} did not answer an OpenAI model list "
                              f"({{\"data\": [{{\"id\": ...}}]}}): {r.text[:200]!r}")
    return data


def resolve_tokenizer(tokenizer: str | None, models: list[dict], model: str) -> tuple[Tokenizer, str]:
    """The tokenizer to use and where it came from.

    Order: ``--tokenizer``; else the served model's ``root`` when it is a local path (sloserve and
    vLLM report the model path there); else the embedded SmolLM2 GGUF.

    Raises:
        FileNotFoundError: ``tokenizer`` given but missing.
    """
    if tokenizer:
        return load_tokenizer(tokenizer), tokenizer
    for m in models:
        root = m.get("root")
        if m.get("id") == model and isinstance(root, str) and os.path.exists(root):
            try:
                return load_tokenizer(root), root
            except ValueError:  # e.g. a dummy-weights folder without tokenizer files
                break
    from sloserve.embedded import default_model_path
    path = default_model_path()
    return load_tokenizer(path), path
