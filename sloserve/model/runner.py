"""Model runner: owns the paged KV cache tensors, turns a SchedulerOutput into one forward pass."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sloserve.engine.scheduler import SchedulerOutput
from sloserve.model.attention import AttentionMetadata, PrefillChunk
from sloserve.model.config import ModelConfig
from sloserve.model.sampler import Sampler


@dataclass
class StepTimings:
    """Seconds spent in one step's phases (perf_counter)."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block over all layers:
    2 * layers * H_kv * head_dim * block_size * dtype bytes (vLLM/PagedAttention)."""
    return config.kv_bytes_per_token_per_elem * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    """Runs the model over the paged KV cache.

    KV cache: per layer one K and one V tensor [num_blocks, block_size, H_kv, head_dim],
    preallocated once.
    """

    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_blocks: int,
                 block_size: int, dtype: torch.dtype, sampler: Sampler):
        self.model = model
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.sampler = sampler
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(config.num_hidden_layers)]
        self.last_timings = StepTimings()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(self, out: SchedulerOutput, block_tables: dict[str, list[int]]):
        """Flatten the step into input tensors.

        Returns:
            (input_ids [T], positions [T], AttentionMetadata, logits_indices [S], sampled
            ScheduledRequests in row order of the logits).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_idx: list[int] = []
        samplers = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        bs = self.block_size
        for sr in out.scheduled:
            req = sr.request
            table = block_tables[sr.request_id]
            t0 = len(input_ids)
            input_ids += req.token_ids_range(sr.start_pos, sr.end_pos)
            positions += range(sr.start_pos, sr.end_pos)
            slots += self._slots(table, sr.start_pos, sr.end_pos)
            nblocks = -(-sr.end_pos // bs)
            if sr.is_decode:
                decode_tables.append(table[:nblocks])
                decode_lens.append(sr.end_pos)
            else:
                ctx = torch.tensor(table[:nblocks], dtype=torch.long) if sr.start_pos else None
                prefills.append(PrefillChunk(t0, len(input_ids), sr.start_pos, ctx))
            if sr.samples:
                logits_idx.append(len(input_ids) - 1)
                samplers.append(sr)
        decode_bt = decode_mask = None
        if decode_tables:
            nmax = max(len(t) for t in decode_tables)
            decode_bt = torch.tensor([t + [0] * (nmax - len(t)) for t in decode_tables],
                                     dtype=torch.long)
            decode_mask = (torch.arange(nmax * bs).unsqueeze(0)
                           < torch.tensor(decode_lens).unsqueeze(1))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=len(decode_tables), decode_block_tables=decode_bt, decode_mask=decode_mask,
            prefills=prefills)
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                meta, torch.tensor(logits_idx, dtype=torch.long), samplers)

    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]]) -> dict[str, int]:
        """Run one step; returns request id -> sampled token for every chunk that samples."""
        t0 = time.perf_counter()
        input_ids, positions, meta, logits_idx, samplers = self.prepare(out, block_tables)
        t1 = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_idx)
        t2 = time.perf_counter()
        toks = self.sampler(logits, [s.request_id for s in samplers],
                            [s.request.sampling_params for s in samplers]) if samplers else []
        t3 = time.perf_counter()
        self.last_timings = StepTimings(t1 - t0, t2 - t1, t3 - t2)
        return {s.request_id: t for s, t in zip(samplers, toks)}
