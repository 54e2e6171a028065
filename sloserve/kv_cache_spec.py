"""The KV cache spec: the one place that says how many bytes a token and a block of KV take.

The worker builds it from the loaded model (:meth:`sloserve.worker.worker.Worker.get_kv_cache_spec`);
the engine core sizes the cache with it (blocks that fit the memory), the model runner allocates
with it, and the roofline calculator and the simulator's capacity use it for their model presets.
Plain data, no torch (vLLM's ``KVCacheSpec`` / ``FullAttentionSpec``, with the layers folded in).

Bytes (vLLM / PagedAttention, Kwon et al., SOSP 2023): the cache holds a K and a V entry per KV
head per layer per token, so one token takes ``2 x layers x kv_heads x entry bytes``; an entry is
``head_dim`` elements plus, in the int8 format (``--kv-cache-dtype int8``,
``sloserve.model.attention.kv_int8``), a float32 scale of :data:`INT8_SCALE_BYTES`. MLA
(DeepSeek-V2/V3) caches one latent plus the shared RoPE key per layer and token, no factor 2
(``use_mla``: ``head_dim`` is that width, ``num_kv_heads`` 1). The CPU kernels' ``kv_head_bytes``
(``sloserve/kernels/csrc``) must agree with :attr:`KVCacheSpec.entry_bytes`; a test checks the
allocated tensors against :attr:`KVCacheSpec.page_size_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: bytes per element of a KV cache dtype, in the engine's spelling and the roofline's
#: (int4: half a byte; fp8 and int4 are modelled without scales: per-tensor on GPUs)
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "fp8": 1, "int8": 1, "int4": 0.5}
#: the int8 cache format: each head's entry of one token is head_dim int8 codes and a float32
#: scale of this many bytes
INT8_SCALE_BYTES = 4


def dtype_bytes(dtype: str) -> float:
    """Bytes per element of a KV cache dtype ("bfloat16" or "bf16", "int8", "int4" = 0.5, ...).

    Raises:
        KeyError: an unknown dtype (the message lists the known ones).
    """
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}") from None


def _num(x: float) -> float:
    """x as an int where it is whole (bytes of real formats are), else as it is (int4)."""
    return int(x) if float(x).is_integer() else x


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache of one model: the layout every layer shares.

    Attributes:
        block_size: tokens per block.
        num_kv_heads: KV heads per layer (1 for MLA).
        head_dim: elements of one head's K (or V) of one token (MLA: latent + RoPE key).
        dtype: the cache's element dtype ("bfloat16", "float32", "int8", "bf16", "fp8", ...).
        num_layers: layers with a KV cache.
        use_mla: one latent per token and layer instead of K and V.
        scale_bytes: bytes after each entry's codes (the int8 format's scale); default: the
            dtype's (:data:`INT8_SCALE_BYTES` for int8, else 0).

    Raises (constructor):
        KeyError: an unknown dtype.
        ValueError: a size below 1.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_layers: int
    use_mla: bool = False
    scale_bytes: int = field(default=-1)

    def __post_init__(self) -> None:
        dtype_bytes(self.dtype)
        for name in ("block_size", "num_kv_heads", "head_dim", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"KV cache spec: {name} must be >= 1, got {getattr(self, name)}")
        if self.scale_bytes < 0:
            object.__setattr__(self, "scale_bytes",
                               INT8_SCALE_BYTES if self.dtype == "int8" else 0)

    @property
    def element_bytes(self) -> float:
        return dtype_bytes(self.dtype)

    @property
    def entry_bytes(self) -> float:
        """Bytes of one head's K (or V) of one token: its elements and its scale."""
        return _num(self.head_dim * self.element_bytes + self.scale_bytes)

    @property
    def entry_width(self) -> int:
        """Elements of the cache dtype one entry takes (head_dim, or head_dim + 4 for int8):
        the last dimension of the cache tensors."""
        return int(self.entry_bytes // self.element_bytes)

    @property
    def bytes_per_token(self) -> float:
        """Bytes of one token over all layers: 2 x layers x kv_heads x entry bytes (MLA: 1 x)."""
        return _num((1 if self.use_mla else 2) * self.num_layers * self.num_kv_heads
                    * self.entry_bytes)

    @property
    def page_size_bytes(self) -> float:
        """Bytes of one block over all layers."""
        return _num(self.bytes_per_token * self.block_size)

    def num_blocks(self, memory_bytes: float) -> int:
        """Whole blocks that ``memory_bytes`` hold."""
        return int(memory_bytes // self.page_size_bytes)
