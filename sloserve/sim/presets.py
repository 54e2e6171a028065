"""``sloserve sim --preset``: the lecture's experiment, naive against chunked on one workload."""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    "lecture": {"dataset_name": "mixed", "request_rate": 6.0, "num_prompts": 2000,
                "decode_step_ms": 22.0, "prefill_tokens_per_s": 35000.0,
                "max_num_batched_tokens": 512, "num_kv_blocks": 100_000},
    "lecture-70b": {"dataset_name": "mixed", "request_rate": 6.0, "num_prompts": 2000,
                    "roofline_model": "Llama-3-70B", "hardware": "H100-SXM", "tp": 8,
                    "max_num_batched_tokens": 512},
}
#: flags a preset refuses: they would change what it compares
PRESET_REFUSES = ("scheduling_policy", "enable_chunked_prefill", "static_batching", "profile", "decode_step_ms", "prefill_tokens_per_s",
                  "roofline_model")
