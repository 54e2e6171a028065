"""The attention-backend seam: backend-neutral step inputs, the backend interface, the registry.

The model runner flattens every query token of a step into one token dimension T, request after
request (B requests; the scheduler puts decodes first), and describes the step with
:class:`StepInputs`, the same for every backend. A backend turns those into its own metadata
(``build_metadata``), owns the layout of the paged KV cache (``kv_cache_shape``, and how blocks are
exported and imported), and computes attention for one layer (``forward``). Each query token of a
request attends causally over its request's context: the cached tokens before it and the
request's earlier query tokens of the step. One contract covers every mix: decodes, prefill chunks
at any offset, and a request with k > 1 query tokens after cached context (a verify step of
speculative decoding).

Backends register by name (:func:`register_backend`); ``--attention-backend auto`` takes the
available one with the highest ``priority``.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class StepInputs:
    """One step's inputs, backend-neutral (T query tokens of B requests; int64 CPU tensors).

    Attributes:
        input_ids: [T] token ids.
        positions: [T] position of each token in its request.
        query_start_loc: [B + 1] request b's query tokens are rows
            ``query_start_loc[b]:query_start_loc[b + 1]`` of T.
        seq_lens: [B] context length after this step (cached + new tokens).
        num_computed_tokens: [B] tokens already cached before this step (seq_lens - query lens).
        block_table: [B, max_blocks] block ids of each request's context, padded with 0
            (max_blocks = the most blocks any request of the step needs).
        slot_mapping: [T] cache slot (block * block_size + offset) each token's K/V goes to.
        logits_indices: [S] rows of T whose next-token logits are needed.
        block_size: tokens per KV block.
        query_lens, seq_lens_list, num_computed_list: host-side (Python) copies, [B] each, for
            backends that plan on the CPU without reading tensors back.
        prompt_lens: [B] each request's prompt length (positions below it are prompt
            positions; 0: not known, every position counts as generated).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int
    query_lens: list[int]
    seq_lens_list: list[int]
    num_computed_list: list[int]
    prompt_lens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(abc.ABC):
    """Attention over the paged KV cache for a flattened mixed batch.

    Subclasses set ``name`` (the ``--attention-backend`` value) and ``priority`` (``auto`` picks
    the highest available), and implement the three abstract methods. The default block
    export/import assume the layout ``[2, num_blocks, ...]`` (K and V, then blocks); a backend
    with another layout overrides them.
    """

    name: ClassVar[str] = "abstract"
    priority: ClassVar[int] = 0
    #: the engine's dtype (set by the engine): where the cache's dtype leaves the choice, a
    #: backend may compute in it (an int8 cache's prefill on bf16 tiles in a bf16 engine)
    compute_dtype: torch.dtype = torch.float32
    #: the KV cache dtypes it reads (None: any)
    kv_cache_dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    #: it can compute each query row's attention independently of the step's other rows and
    #: of how the request was chunked (``--batch-invariant``, see ``sloserve.model.invariant``)
    supports_batch_invariant: ClassVar[bool] = False
    #: set by the engine: ``--batch-invariant`` is on
    batch_invariant: bool = False

    @classmethod
    def supports(cls, kv_cache_dtype: torch.dtype | None) -> bool:
        """Whether it reads a KV cache of this dtype (None: any dtype will do)."""
        return kv_cache_dtype is None or cls.kv_cache_dtypes is None or \
            kv_cache_dtype in cls.kv_cache_dtypes

    @classmethod
    def is_available(cls) -> bool:
        """Whether it can run in this process (kernels present, instruction set, device)."""
        return True

    @staticmethod
    @abc.abstractmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                       entry_width: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (K and V together); ``entry_width``: elements of
        one head's entry of one token (head_dim, or head_dim + 4 for an int8 cache:
        ``KVCacheSpec.entry_width``)."""

    def describe(self, kv_cache_dtype: torch.dtype) -> str:
        """How this backend will attend over a ``kv_cache_dtype`` cache, for the start-up log
        line: its name, and where it picks kernels by CPU, the ones it picked."""
        return self.name

    @abc.abstractmethod
    def build_metadata(self, inputs: StepInputs) -> Any:
        """This backend's per-step metadata (built once per step, shared by all layers)."""

    @abc.abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: Any, scale: float) -> torch.Tensor:
        """Write the step's K/V into the cache and attend, for one layer.

        Args:
            q: [T, H, D] queries (RoPE applied).
            k, v: [T, H_kv, D] the step's keys (RoPE applied) and values.
            kv_cache: this layer's cache, shaped ``kv_cache_shape(...)``, any dtype.
            meta: what ``build_metadata`` returned for this step.
            scale: softmax scale, usually 1 / sqrt(D).

        Returns:
            [T, H, D] attention output in q's dtype.
        """

    # ------------------------------------------------------------------ KV export / import
    def export_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """One layer's KV of ``block_ids`` ([n] int64) as a new contiguous tensor
        ([2, n, block_size, H_kv, D] for the default layout)."""
        return kv_cache.index_select(1, block_ids)

    def import_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                      data: torch.Tensor) -> None:
        """Write ``data`` (as :meth:`export_blocks` returns it) into ``block_ids`` of one layer."""
        kv_cache.index_copy_(1, block_ids, data.to(kv_cache.dtype))


_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: make ``cls`` selectable by ``--attention-backend cls.name``.

    Raises:
        ValueError: another backend already has that name.
    """
    if cls.name in _BACKENDS and _BACKENDS[cls.name] is not cls:
        raise ValueError(f"attention backend {cls.name!r} is registered twice")
    _BACKENDS[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    """Names of the registered backends that can run here, best (highest priority) first."""
    ok = [c for c in _BACKENDS.values() if c.is_available()]
    return [c.name for c in sorted(ok, key=lambda c: -c.priority)]


def get_attention_backend(name: str = "auto",
                          kv_cache_dtype: torch.dtype | None = None) -> AttentionBackend:
    """A backend instance by name; ``auto``: the best available that reads a KV cache of
    ``kv_cache_dtype`` (None: any).

    Raises:
        ValueError: an unknown name, a backend that cannot run here, or one that cannot read a
            KV cache of that dtype (each message lists the choices).
    """
    if name == "auto":
        names = [n for n in available_backends() if _BACKENDS[n].supports(kv_cache_dtype)]
        if not names:  # pragma: no cover - the reference backend reads every dtype
            raise ValueError("no attention backend can run here")
        return _BACKENDS[names[0]]()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: "
                         f"{', '.join(['auto', *available_backends()])}")
    cls = _BACKENDS[name]
    if not cls.is_available():
        raise ValueError(f"attention backend {name!r} cannot run here; available: "
                         f"{', '.join(['auto', *available_backends()])}")
    if not cls.supports(kv_cache_dtype):
        names = [str(d).removeprefix("torch.") for d in (*cls.kv_cache_dtypes, kv_cache_dtype)]
        raise ValueError(f"attention backend {name!r} reads a {', '.join(names[:-1])} KV cache, "
                         f"not {names[-1]}; use --kv-cache-dtype {names[0]} or another "
                         f"--attention-backend (auto picks one)")
    return cls()
