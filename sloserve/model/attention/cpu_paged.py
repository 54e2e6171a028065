"""``cpu-paged``: attention on this project's CPU kernels, reading K/V in place from the paged cache.

Same KV layout as ``torch-ref`` (``[2, num_blocks, block_size, H_kv, D]`` per layer, so the two
are interchangeable on one cache). Per step:

* the step's K/V are written at their slots by the kernel (float32 in, the cache's dtype out);
* requests with one query token (decodes) run the paged decode kernel: for each request and KV
  head, the G query heads of the group walk the request's blocks in place (no gather of the
  context), with a softmax state per split of ``split_len`` tokens merged by log-sum-exp, so a
  long context in a small batch still spreads over every thread (FlashDecoding);
* requests with several query tokens (prefill chunks, verify steps): where the CPU has AMX or
  AVX512-BF16 and the cache is bf16, the kernels' flash attention over the request's blocks in
  place (its cached and new positions in one pass, causal; on AMX 2-3x torch's CPU flash
  attention on the embedded model's shapes, measured; on AVX512-BF16 without AMX see
  ``Kernels.prefill_attn``); an int8 cache in a bf16 engine: the same kernel over a
  bf16 copy of the request's context (dequantized per step and layer: ~0.4 MB for 2,048
  tokens); elsewhere the reference path (torch's flash attention).

The KV cache is float32, bf16 or int8 (``kv_int8``: D codes and a float32 scale per head and
token, half the bytes of bf16 for the decode kernel to read).

With ``--batch-invariant`` (``sloserve.model.invariant``) each position is always computed by
the same kernel, one whose result for a query row depends on that row alone, whatever chunk,
step or thread count it comes in:

* prompt positions (below the request's prompt length): the flash attention kernel's invariant
  variant (``Kernels.prefill_attn(..., invariant=True)``: no query lane affects another), also
  for a one-token chunk and for the last prompt token recomputed after a full prefix-cache hit;
* generated positions (decodes, and tokens recomputed after a preemption or verified as
  drafts): the paged decode kernel, each row as a request of its own whose context ends at its
  position (splits at fixed multiples of ``SPLIT_LEN`` positions, merged in order).

Where the flash kernel does not run (no AMX / AVX512-BF16, a float32 cache or engine) every row
takes the decode kernel that way, prompt rows included (slower prefills, same guarantee).

Available where the kernels load (``sloserve.kernels``); ``auto`` prefers it to ``torch-ref``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sloserve.model.attention.backend import AttentionBackend, StepInputs, register_backend
from sloserve.model.attention import kv_int8
from sloserve.model.attention.torch_ref import MultiQuery, TorchReferenceBackend, _multi

#: context tokens per split of the decode kernel
SPLIT_LEN = 256
#: a request past its prompt with at most this many query tokens in a step (a decode verifying
#: draft tokens) runs on the decode kernel, one row per query token, each row's context ending
#: at its own position: a step of decodes and verifies stays one kernel call per layer (prompt
#: chunks, however short, keep the prefill kernels: served tokens do not change)
DECODE_KERNEL_MAX_QUERY = 16


@dataclass
class CpuPagedMetadata:
    """Attributes:
        slot_mapping: [T] int64.
        decode_rows: [B_d] int64 rows of T computed on the decode kernel (None if none): every
            query row of the requests past their prompt with at most
            :data:`DECODE_KERNEL_MAX_QUERY` of them (a decode and its draft tokens).
        block_table: [B_d, N_max] int64 each row's request's block table; seq_lens: [B_d]
            int64 each row's context (up to and including its own position).
        max_seq_len: longest decode context.
        multi: the requests with more query tokens (the prefill kernels).
        all_decode: every row of the step is a decode, in order (decode_rows is 0..T-1): the
            kernel's output is the step's output, no gather/scatter.
        multi_blocks: per entry of ``multi``, the request's block table over its whole context
            (int64, contiguous), for the AMX prefill kernel.
        invariant: --batch-invariant's layout (``_invariant_metadata``): decode_rows /
            block_table / seq_lens cover every row of the step (each its own context), multi
            the prompt positions only, gen_rows the generated ones (None if none).
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    block_table: torch.Tensor | None
    seq_lens: torch.Tensor | None
    max_seq_len: int
    multi: list[MultiQuery]
    all_decode: bool = False
    multi_blocks: list[torch.Tensor] | None = None
    invariant: bool = False
    gen_rows: torch.Tensor | None = None


@register_backend
class CpuPagedBackend(AttentionBackend):
    """See the module docstring."""

    name = "cpu-paged"
    priority = 10
    supports_batch_invariant = True
    # the kernels read bf16, float32 or int8 entries (a float16 cache read as float32 ran off
    # its end)
    kv_cache_dtypes = (torch.float32, torch.bfloat16, torch.int8)

    def __init__(self):
        from sloserve import kernels
        self.k = kernels.load()
        if self.k is None:
            raise ValueError("the cpu-paged backend needs the CPU kernels (sloserve.kernels)")

    def _context_dtype(self, kv_cache_dtype: torch.dtype, q_dtype: torch.dtype) -> torch.dtype:
        """The dtype a multi-token query reads its context in: the cache's, or for an int8 cache
        bf16 in a bf16 engine (a dequantized copy, for the fused kernel) and q's dtype otherwise
        (the float32 engine keeps the dequantized values exact, on the torch path)."""
        if kv_cache_dtype != torch.int8:
            return kv_cache_dtype
        return torch.bfloat16 if self.compute_dtype == torch.bfloat16 else q_dtype

    def describe(self, kv_cache_dtype: torch.dtype) -> str:
        isa = self.k.prefill_attn_isa
        # the fused forward's queries are float32
        bf16 = self._context_dtype(kv_cache_dtype, torch.float32) == torch.bfloat16
        multi = (f"{isa} flash attention over the cache in place" if isa and bf16
                 else "torch's flash attention")
        return f"{self.name} (decodes: paged decode kernel; prefill chunks: {multi})"

    @classmethod
    def is_available(cls) -> bool:
        from sloserve import kernels
        return kernels.load() is not None

    kv_cache_shape = staticmethod(TorchReferenceBackend.kv_cache_shape)

    def build_metadata(self, inputs: StepInputs) -> CpuPagedMetadata:
        if self.batch_invariant:
            return self._invariant_metadata(inputs)
        bs, qlens = inputs.block_size, inputs.query_lens
        if all(n == 1 for n in qlens):  # the common step: every request one decode
            return CpuPagedMetadata(inputs.slot_mapping, torch.arange(len(qlens)),
                                    inputs.block_table, inputs.seq_lens, max(inputs.seq_lens_list),
                                    [], all_decode=True, multi_blocks=[])
        plens = inputs.prompt_lens or [0] * len(qlens)
        small = [n == 1 or (n <= DECODE_KERNEL_MAX_QUERY and done >= plen)  # a decode, verify
                 for n, done, plen in zip(qlens, inputs.num_computed_list, plens)]
        qsl = inputs.query_start_loc.tolist()
        multi = [c for c in TorchReferenceBackend.build_metadata(self, inputs).multi
                 if not small[qsl.index(c.q_start)]]
        mb = [inputs.block_table[b, :-(-seq // bs)].contiguous()
              for b, seq in enumerate(inputs.seq_lens_list)
              if not small[b]] if self.k.prefill_attn_isa else None
        if not any(small):
            return CpuPagedMetadata(inputs.slot_mapping, None, None, None, 0, multi,
                                    multi_blocks=mb)
        rows = [r for b, s in enumerate(small) if s for r in range(qsl[b], qsl[b + 1])]
        owner = [b for b, s in enumerate(small) if s for _ in range(qlens[b])]
        idx = torch.tensor(rows, dtype=torch.long)
        lens = inputs.positions.index_select(0, idx) + 1  # each row's context ends at itself
        return CpuPagedMetadata(inputs.slot_mapping, idx,
                                inputs.block_table.index_select(
                                    0, torch.tensor(owner, dtype=torch.long)).contiguous(),
                                lens, int(lens.max()), multi, all_decode=all(small),
                                multi_blocks=mb)

    def _invariant_metadata(self, inputs: StepInputs) -> CpuPagedMetadata:
        """--batch-invariant (see the module docstring): every row as a decode of its own (its
        request's block table, its context ending at its position), and each request's prompt
        positions of the step as one flash-kernel entry."""
        T, bs = inputs.num_tokens, inputs.block_size
        req = torch.repeat_interleave(torch.arange(inputs.num_reqs),
                                      torch.tensor(inputs.query_lens, dtype=torch.long))
        qsl = inputs.query_start_loc.tolist()
        multi, blocks, gen = [], [], []
        prompt_lens = inputs.prompt_lens or [0] * inputs.num_reqs
        for b, (start, plen) in enumerate(zip(inputs.num_computed_list, prompt_lens)):
            n_prompt = max(0, min(inputs.query_lens[b], plen - start))
            if n_prompt:
                multi.append(MultiQuery(qsl[b], qsl[b] + n_prompt, start, None))
                blocks.append(inputs.block_table[b, :-(-(start + n_prompt) // bs)].contiguous())
            gen += range(qsl[b] + n_prompt, qsl[b + 1])
        return CpuPagedMetadata(inputs.slot_mapping, torch.arange(T),
                                inputs.block_table.index_select(0, req).contiguous(),
                                inputs.positions + 1, max(inputs.seq_lens_list), multi,
                                all_decode=True, multi_blocks=blocks, invariant=True,
                                gen_rows=torch.tensor(gen, dtype=torch.long) if gen else None)

    def _forward_invariant(self, q, kv_cache, meta: CpuPagedMetadata, scale):
        """--batch-invariant's attention (the step's K/V already written)."""
        cd = self._context_dtype(kv_cache.dtype, q.dtype)
        qf = q if q.dtype == torch.float32 else q.float()
        if qf.stride(-1) != 1 or qf.stride(1) != qf.shape[2]:
            qf = qf.contiguous()
        if not (meta.multi and self.k.prefill_attn_isa and cd == torch.bfloat16
                and q.shape[2] % 32 == 0):  # every row on the decode kernel
            return self.k.paged_attn_decode(qf, kv_cache, meta.block_table, meta.seq_lens,
                                            meta.max_seq_len, scale, SPLIT_LEN).to(q.dtype)
        out = torch.empty(q.shape, dtype=torch.float32)
        if meta.gen_rows is not None:
            g = meta.gen_rows
            out.index_copy_(0, g, self.k.paged_attn_decode(
                qf.index_select(0, g), kv_cache, meta.block_table.index_select(0, g),
                meta.seq_lens.index_select(0, g), meta.max_seq_len, scale, SPLIT_LEN))
        for c, blocks in zip(meta.multi, meta.multi_blocks):
            cache = kv_cache
            if kv_cache.dtype == torch.int8:  # a bf16 copy of the request's context
                cache = kv_int8.dequantize(kv_cache.index_select(1, blocks), cd)
                blocks = torch.arange(blocks.shape[0])
            out[c.q_start:c.q_end] = self.k.prefill_attn(qf[c.q_start:c.q_end], cache, blocks,
                                                         c.num_computed, scale, invariant=True)
        return out.to(q.dtype)

    def forward(self, q, k, v, kv_cache, meta: CpuPagedMetadata, scale):
        kf = k if k.dtype == torch.float32 else k.float()
        vf = v if v.dtype == torch.float32 else v.float()
        if kf.stride(-1) != 1 or kf.stride(1) != kf.shape[2]:
            kf, vf = kf.contiguous(), vf.contiguous()
        self.k.cache_write(kf, vf, kv_cache, meta.slot_mapping)
        if meta.invariant:
            return self._forward_invariant(q, kv_cache, meta, scale)
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
        if not meta.multi:
            return out
        int8 = kv_cache.dtype == torch.int8
        cd = self._context_dtype(kv_cache.dtype, q.dtype)
        fused = (meta.multi_blocks is not None and cd == torch.bfloat16 and q.dtype == torch.float32
                 and q.shape[2] % 32 == 0 and q.stride(-1) == 1 and q.stride(1) == q.shape[2])
        if int8 and not fused:  # the step's own K/V as the cache holds them (see write_cache)
            written = kv_cache.view(2, -1, *kv_cache.shape[3:]).index_select(1, meta.slot_mapping)
            k, v = kv_int8.dequantize(written, k.dtype)
        for i, c in enumerate(meta.multi):
            s = slice(c.q_start, c.q_end)
            if fused:
                cache, blocks = kv_cache, meta.multi_blocks[i]
                if int8:
                    cache = kv_int8.dequantize(kv_cache.index_select(1, blocks), cd)
                    blocks = torch.arange(blocks.shape[0])
                out[s] = self.k.prefill_attn(q[s], cache, blocks, c.num_computed, scale)
                continue
            # flash attention in the cache's dtype (bf16 math where the CPU has it: a
            # 512-token prompt's attention 4.3 -> ~1.5 ms per layer measured)
            out[s] = _multi(q[s].to(cd), k[s].to(cd), v[s].to(cd), kv_cache[0], kv_cache[1], c,
                            scale).to(q.dtype)
        return out
