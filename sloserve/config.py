"""Engine configuration (CLI flags follow vLLM's spelling)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything needed to build an engine.

    Attributes:
        model: GGUF file or Hugging Face folder; None = the embedded SmolLM2-135M-Instruct GGUF.
        served_model_name: name in the API (default: the model's own name).
        dtype: "auto" (default: bfloat16 where this CPU's bf16 matmul is native, float32 where it
            is emulated; see sloserve.platform), "bfloat16", "float32" or "float16".
        kv_cache_dtype: "auto" (= the chosen dtype) or a dtype for the paged KV cache.
        load_format: "auto", "gguf", "safetensors", or "dummy" (random weights from config.json).
        block_size: tokens per KV block.
        kv_cache_memory: GiB for the KV cache (used when num_kv_blocks is None).
        num_kv_blocks: exact number of KV blocks (overrides kv_cache_memory).
        max_num_batched_tokens: token budget per step.
        max_num_seqs: most requests running at once.
        max_model_len: longest prompt + output (tokens); None = the model's context length.
        scheduling_policy: "chunked", "naive" or "static".
        seed: seed of the engine RNG (unseeded sampling requests draw their seeds from it).
        attention_backend: name of the attention backend.
        num_threads: torch intra-op threads (None: torch's default).
    """

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    kv_cache_memory: float = 1.0
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    scheduling_policy: str = "chunked"
    seed: int = 0
    attention_backend: str = "torch-ref"
    num_threads: int | None = None
