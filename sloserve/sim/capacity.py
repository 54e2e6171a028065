"""KV-cache capacity of a simulated instance, from the roofline calculator's model specs (the
same formula the engine sizes its cache with, ``sloserve.roofline.kv``)."""
from __future__ import annotations

from sloserve.roofline.kv import blocks_that_fit, dtype_bytes, kv_bytes_per_token

GiB = 1024 ** 3


def kv_blocks(memory_gib: float, model: str, dtype: str, block_size: int) -> int:
    """KV blocks of ``block_size`` tokens that ``memory_gib`` GiB hold for ``model`` (a
    ``sloserve roofline`` preset, config.json or GGUF) with KV in ``dtype`` ("bf16", ...).
    The embedded SmolLM2 in bf16 at the engine's default 1 GiB: 2,912 blocks of 16.

    Raises:
        KeyError: an unknown model or dtype.
    """
    from sloserve.roofline.models import get_model
    return blocks_that_fit(memory_gib * GiB, kv_bytes_per_token(get_model(model), dtype), block_size)


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
    return max(1, blocks_that_fit(free, kv_bytes_per_token(spec, dtype), block_size))
