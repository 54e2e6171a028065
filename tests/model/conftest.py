"""Model-side fixtures. The tiny checkpoint folders (``tiny_llama_dir``, ``tiny_qwen2_dir``,
``tiny_mqa_dir``, ``tiny_mha_dir``) and ``gguf_path`` / ``smollm2_hf_tokenizer`` live in
``tests/conftest.py`` so every test package can use them."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_weights(gguf_path):
    """``load_weights(embedded GGUF, "float32")`` -- the embedded SmolLM2 as LoadedWeights."""
    from sloserve.model.loader import load_weights

    return load_weights(gguf_path, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_hf_model(gguf_path):
    """transformers' own ``LlamaForCausalLM`` loaded from the embedded GGUF (float32, eval).

    The independent reference for the dequantize + un-permute path; needs ``accelerate``
    (in the project's test extra; a missing one fails loudly instead of skipping). Slow (~15-20 s on CPU,
    transformers parses the GGUF with gguf.GGUFReader twice).
    """
    import accelerate  # noqa: F401  (transformers needs it to load a GGUF model)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32, local_files_only=True)
    return model.eval()
