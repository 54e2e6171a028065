"""KV-cache capacity of a simulated instance, from the roofline calculator's model specs and the
engine's own KV cache spec (``sloserve.kv_cache_spec``: an int8 cache counts its scales)."""
from __future__ import annotations

from sloserve.roofline.kv import dtype_bytes, kv_cache_spec

GiB = 1024 ** 3


def kv_blocks(memory_gib: float, model: str, dtype: str, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that ``memory_gib`` GiB hold for ``model`` (a
    ``sloserve roofline`` preset, config.json or GGUF) with KV in ``dtype`` ("bf16", ...).
    The embedded SmolLM2 in bf16 at the engine's default 1 GiB: 2,912 blocks of 16.

    Raises:
        KeyError: an unknown model or dtype.
    """
    from sloserve.roofline.models import get_model
    return kv_cache_spec(get_model(model), dtype, block_size).num_blocks(memory_gib * GiB)


def kv_blocks_after_weights(model: str, hardware: str, tp: int, dtype: str, block_size: int,
                            memory_fraction: float = 0.9) -> int:
    """KV blocks that ``memory_fraction`` of ``tp`` x the GPU's memory hold after the weights
    (the lecture-70b preset: 90 % of 8 x 80 GiB minus Llama-3-70B's weights).

    Raises:
        KeyError: an unknown model, hardware or dtype.
    """
    from sloserve.roofline.hardware import get_hardware
    from sloserve.roofline.models import get_model
    spec, hw = get_model(model), get_hardware(hardware)
    free = memory_fraction * tp * hw.mem_bytes - spec.num_params() * dtype_bytes(dtype)
    return max(1, kv_cache_spec(spec, dtype, block_size).num_blocks(free))
