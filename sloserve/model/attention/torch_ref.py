"""The PyTorch reference attention backend (``torch-ref``): clear, on torch's own CPU kernels, and
the correctness oracle the faster backends are tested against.

KV layout: one tensor per layer, ``[2, num_blocks, block_size, H_kv, D]`` (K then V; an int8
cache's last dimension is D + 4: codes and a scale, see ``kv_int8``). Per step it
scatters the new K/V by slot mapping, then

* requests with one query token (decodes) run as one batched ``scaled_dot_product_attention``
  over their contexts gathered by block table (whole blocks, one copy each) with a key-padding
  mask;
* a request with several query tokens and no cached context (a first prefill chunk) runs one
  causal flash call;
* a request with several query tokens after cached context (a later chunk, a verify step)
  attends to the cached part without a mask and to its own tokens causally, as two flash calls
  merged by their log-sum-exp (:func:`split_attention`).

GQA/MQA go through ``enable_gqa`` or by folding the query heads of a KV head together; K/V are
never repeated per query head in the cached part.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sloserve.model.attention import kv_int8
from sloserve.model.attention.backend import AttentionBackend, StepInputs, register_backend

#: CPU flash-attention op that also returns the log-sum-exp (a private ATen op; None if absent)
FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@dataclass
class MultiQuery:
    """A request with several query tokens: rows [q_start, q_end) of T, positions
    num_computed .. num_computed + n - 1; ``context_blocks`` [ceil(seq_len / block_size)]
    int64 (None when nothing was cached before: the chunk is its whole context)."""

    q_start: int
    q_end: int
    num_computed: int
    context_blocks: torch.Tensor | None


@dataclass
class TorchRefMetadata:
    """Attributes:
        slot_mapping: [T] int64.
        decode_rows: [B_d] int64 rows of T of the single-query requests (None if none).
        decode_block_table: [B_d, N_max] their block tables, padded with block 0.
        decode_mask: [B_d, N_max * block_size] bool, True at positions < their seq_len.
        multi: the requests with several query tokens.
    """

    slot_mapping: torch.Tensor
    decode_rows: torch.Tensor | None
    decode_block_table: torch.Tensor | None
    decode_mask: torch.Tensor | None
    multi: list[MultiQuery]


@register_backend
class TorchReferenceBackend(AttentionBackend):
    """See the module docstring."""

    name = "torch-ref"
    priority = 0

    @staticmethod
    def kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim):
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, inputs: StepInputs) -> TorchRefMetadata:
        bs = inputs.block_size
        qsl = inputs.query_start_loc.tolist()
        dec, multi = [], []
        for b, (n, seq) in enumerate(zip(inputs.query_lens, inputs.seq_lens_list)):
            if n == 1:
                dec.append(b)
            else:
                done = inputs.num_computed_list[b]
                blocks = inputs.block_table[b, :-(-seq // bs)] if done else None
                multi.append(MultiQuery(qsl[b], qsl[b + 1], done, blocks))
        rows = table = mask = None
        if dec:
            lens = torch.tensor([inputs.seq_lens_list[b] for b in dec])
            nmax = -(-int(lens.max()) // bs)
            idx = torch.tensor(dec)
            rows = torch.tensor([qsl[b] for b in dec])
            table = inputs.block_table.index_select(0, idx)[:, :nmax]
            mask = torch.arange(nmax * bs).unsqueeze(0) < lens.unsqueeze(1)
        return TorchRefMetadata(inputs.slot_mapping, rows, table, mask, multi)

    def forward(self, q, k, v, kv_cache, meta: TorchRefMetadata, scale):
        k, v = write_cache(k, v, kv_cache, meta.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            out.index_copy_(0, meta.decode_rows, _decode(q.index_select(0, meta.decode_rows),
                                                         k_cache, v_cache, meta, scale))
        for c in meta.multi:
            s = slice(c.q_start, c.q_end)
            out[s] = _multi(q[s], k[s], v[s], k_cache, v_cache, c, scale)
        return out


def write_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Store the step's K and V [T, H_kv, D] at ``slots`` of one layer's cache in its dtype (the
    cache may hold another dtype than the activations: ``--kv-cache-dtype``). Returns the K and V
    the step's own queries attend to: as given, or for an int8 cache as read back from it
    (dequantized), so that a token sees the same values whether it is in the step or cached."""
    int8 = kv_cache.dtype == torch.int8
    ke, ve = ((kv_int8.quantize(k), kv_int8.quantize(v)) if int8
              else (k.to(kv_cache.dtype), v.to(kv_cache.dtype)))
    kv_cache[0].view(-1, *ke.shape[1:]).index_copy_(0, slots, ke)
    kv_cache[1].view(-1, *ve.shape[1:]).index_copy_(0, slots, ve)
    if int8:
        return kv_int8.dequantize(ke, k.dtype), kv_int8.dequantize(ve, v.dtype)
    return k, v


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[num_blocks, block_size, H_kv, entry] at ``blocks`` [..., N] -> [..., N * block_size,
    H_kv, D] in ``dtype`` (an int8 cache's entries dequantized)."""
    g = cache.index_select(0, blocks.reshape(-1))
    g = kv_int8.dequantize(g, dtype) if cache.dtype == torch.int8 else g.to(dtype)
    return g.view(*blocks.shape[:-1], -1, cache.shape[2], g.shape[-1])


def _decode(q, k_cache, v_cache, meta: TorchRefMetadata, scale):
    b, h, d = q.shape
    kc = gather_blocks(k_cache, meta.decode_block_table, q.dtype).transpose(1, 2)  # [B, H_kv, L, D]
    vc = gather_blocks(v_cache, meta.decode_block_table, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.view(b, h, 1, d), kc, vc,
                                       attn_mask=meta.decode_mask[:, None, None, :],
                                       scale=scale, enable_gqa=True)
    return o.view(b, h, d)


def _multi(q, k, v, k_cache, v_cache, c: MultiQuery, scale):
    # 4-D [1, H, n, D] inputs: with 3-D ones CPU SDPA takes a path ~15x slower in bf16
    # (a causal 1024-token prompt: 2.2 s against 0.15 s over 30 layers)
    if c.context_blocks is None:             # nothing cached: the chunk is the whole context
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=True,
                                           scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    past_k = gather_blocks(k_cache, c.context_blocks, q.dtype)[:c.num_computed]   # [P, H_kv, D]
    past_v = gather_blocks(v_cache, c.context_blocks, q.dtype)[:c.num_computed]
    if FLASH_CPU is not None:
        return split_attention(q, k, v, past_k, past_v, scale)
    total = c.num_computed + q.shape[0]
    kc, vc = torch.cat([past_k, k]), torch.cat([past_v, v])
    mask = torch.arange(total).unsqueeze(0) <= torch.arange(c.num_computed, total).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc.transpose(0, 1)[None],
                                       vc.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def split_attention(q, k, v, past_k, past_v, scale):
    """Attention of n query tokens after P cached ones, as two flash calls merged by their
    log-sum-exp.

    The queries see every cached position (no mask) and their own tokens causally. An explicit
    offset-causal mask sends SDPA down a path 10x slower on CPU in bf16 (a 512-token chunk at
    position 3000 took 3.6 s over 30 layers against 0.26 s this way), so the two parts run
    mask-free / is_causal and are combined as in FlashAttention's split-K (Dao et al. 2022,
    section 3.1): o = sum_i exp(lse_i - lse) o_i, lse = logsumexp_i lse_i. For the mask-free
    part the G = H / H_kv query heads of a KV head are folded into the query length, so K/V are
    never repeated there.

    Args:
        q: [n, H, D]; k, v: [n, H_kv, D] the request's own new keys/values;
        past_k, past_v: [P, H_kv, D].

    Returns:
        [n, H, D] in q's dtype.
    """
    n, h, d = q.shape
    n_kv = k.shape[1]
    g = h // n_kv
    qh = q.transpose(0, 1)                                                 # [H, n, D]
    o1, l1 = FLASH_CPU(qh.reshape(1, n_kv, g * n, d), past_k.transpose(0, 1).unsqueeze(0),
                       past_v.transpose(0, 1).unsqueeze(0), 0.0, False, scale=scale)
    kr = k.transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)            # [1, H, n, D]
    vr = v.transpose(0, 1).repeat_interleave(g, 0).unsqueeze(0)
    o2, l2 = FLASH_CPU(qh.unsqueeze(0), kr, vr, 0.0, True, scale=scale)
    l1, l2 = l1.reshape(h, n, 1), l2.reshape(h, n, 1)
    lse = torch.logaddexp(l1, l2)
    o = (o1.reshape(h, n, d).float() * torch.exp(l1 - lse)
         + o2.reshape(h, n, d).float() * torch.exp(l2 - lse))
    return o.to(q.dtype).transpose(0, 1)
