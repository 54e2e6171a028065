"""``cpu-paged``: attention on this project's CPU kernels, reading K/V in place from the paged cache.

Same KV layout as ``torch-ref`` (``[2, num_blocks, block_size, H_kv, D]`` per layer, so the two
are interchangeable on one cache). Per step:

* the step's K/V are written at their slots by the kernel (float32 in, the cache's dtype out);
* requests with one query token (decodes) run the paged decode kernel: for each request and KV
  head, the G query heads of the group walk the request's blocks in place (no gather of the
  context), with a softmax state per split of ``split_len`` tokens merged by log-sum-exp, so a
  long context in a small batch still spreads over every thread (FlashDecoding);
* requests with several query tokens (prefill chunks, verify steps) go through the reference
  path (torch's flash attention), which is compute-bound there.

Available where the kernels load (``sloserve.kernels``); ``auto`` prefers it to ``torch-ref``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sloserve.model.attention.backend import AttentionBackend, StepInputs, register_backend
from sloserve.model.attention.torch_ref import MultiQuery, TorchReferenceBackend, _multi

#: context tokens per split of the decode kernel
SPLIT_LEN = 256


@dataclass
class CpuPagedMetadata:
    """Attributes:
        slot_mapping: [T] int64.
        decode_rows: [B_d] int64 rows of T of the single-query requests (None if none).
        block_table: [B_d, N_max] int64 their block tables; seq_lens: [B_d] int64.
        max_seq_len: longest decode context.
        multi: the requests with several query tokens.
        all_decode: every row of the step is a decode, in order (decode_rows is 0..T-1): the
            kernel's output is the step's output, no gather/scatter.
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    block_table: torch.Tensor | None
    seq_lens: torch.Tensor | None
    max_seq_len: int
    multi: list[MultiQuery]
    all_decode: bool = False


@register_backend
class CpuPagedBackend(AttentionBackend):
    """See the module docstring."""

    name = "cpu-paged"
    priority = 10

    def __init__(self):
        from sloserve import kernels
        self.k = kernels.load()
        if self.k is None:
            raise ValueError("the cpu-paged backend needs the CPU kernels (sloserve.kernels)")

    @classmethod
    def is_available(cls) -> bool:
        from sloserve import kernels
        return kernels.load() is not None

    kv_cache_shape = staticmethod(TorchReferenceBackend.kv_cache_shape)

    def build_metadata(self, inputs: StepInputs) -> CpuPagedMetadata:
        ref = TorchReferenceBackend.build_metadata(self, inputs)
        if ref.decode_rows is None:
            return CpuPagedMetadata(inputs.slot_mapping, None, None, None, 0, ref.multi)
        dec = [b for b, n in enumerate(inputs.query_lens) if n == 1]
        idx = torch.tensor(dec, dtype=torch.long)
        lens = inputs.seq_lens.index_select(0, idx).contiguous()
        return CpuPagedMetadata(inputs.slot_mapping, ref.decode_rows,
                                inputs.block_table.index_select(0, idx).contiguous(), lens,
                                max(inputs.seq_lens_list[b] for b in dec), ref.multi,
                                all_decode=len(dec) == len(inputs.query_lens))

    def forward(self, q, k, v, kv_cache, meta: CpuPagedMetadata, scale):
        kf = k if k.dtype == torch.float32 else k.float()
        vf = v if v.dtype == torch.float32 else v.float()
        if kf.stride(-1) != 1 or kf.stride(1) != kf.shape[2]:
            kf, vf = kf.contiguous(), vf.contiguous()
        self.k.cache_write(kf, vf, kv_cache, meta.slot_mapping)
        if meta.all_decode and q.dtype == torch.float32 and q.stride(-1) == 1 \
                and q.stride(1) == q.shape[2]:
            return self.k.paged_attn_decode(q, kv_cache, meta.block_table, meta.seq_lens,
                                            meta.max_seq_len, scale, SPLIT_LEN)
        out = torch.empty(q.shape, dtype=q.dtype)
        if meta.decode_rows is not None:
            qd = q.index_select(0, meta.decode_rows).float().contiguous()
            od = self.k.paged_attn_decode(qd, kv_cache, meta.block_table, meta.seq_lens,
                                          meta.max_seq_len, scale, SPLIT_LEN)
            out.index_copy_(0, meta.decode_rows, od.to(q.dtype))
        # several query tokens: flash attention in the cache's dtype (bf16 math where the CPU
        # has it: a 512-token prompt's attention 4.3 -> ~1.5 ms per layer measured)
        cd = kv_cache.dtype
        for c in meta.multi:
            s = slice(c.q_start, c.q_end)
            out[s] = _multi(q[s].to(cd), k[s].to(cd), v[s].to(cd), kv_cache[0], kv_cache[1], c,
                            scale).to(q.dtype)
        return out
