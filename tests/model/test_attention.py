"""The reference attention backend: the split (two flash calls merged by log-sum-exp) path for a
later prefill chunk equals plain masked attention; batched padded decode equals per-request."""
from __future__ import annotations

import pytest
import torch

from sloserve.model import attention as att
from sloserve.model.attention import PrefillChunk, TorchReferenceBackend

BS = 4


def _cache(n_blocks, n_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_blocks, BS, n_kv, d, generator=g, dtype=torch.float32).to(dtype),
            torch.randn(n_blocks, BS, n_kv, d, generator=g, dtype=torch.float32).to(dtype))


def _masked_reference(q, kc, vc, start):
    """Plain attention in float64: query i (position start + i) sees positions <= start + i."""
    n, h, d = q.shape
    g = h // kc.shape[1]
    k = kc.double().repeat_interleave(g, 1).transpose(0, 1)   # [H, L, D]
    v = vc.double().repeat_interleave(g, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) / d ** 0.5
    mask = torch.arange(kc.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("h,n_kv", [(8, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("use_flash", [True, False])
def test_later_prefill_chunk_matches_masked_attention(h, n_kv, use_flash, monkeypatch):
    if not use_flash:
        monkeypatch.setattr(att, "_FLASH_CPU", None)  # the masked-SDPA fallback
    elif att._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash op with log-sum-exp")
    d, start, n = 16, 13, 7                  # chunk at positions 13..19: blocks 0..4
    k_cache, v_cache = _cache(8, n_kv, d, torch.float32)
    blocks = torch.tensor([5, 2, 7, 0, 3])  # a scattered block table
    flat_k = k_cache[blocks].reshape(-1, n_kv, d)
    flat_v = v_cache[blocks].reshape(-1, n_kv, d)
    q = torch.randn(n, h, d, generator=torch.Generator().manual_seed(1))
    k, v = flat_k[start:start + n], flat_v[start:start + n]  # the chunk's own K/V (already cached)
    out = TorchReferenceBackend._prefill(q, k, v, k_cache, v_cache,
                                         PrefillChunk(0, n, start, blocks), d ** -0.5)
    ref = _masked_reference(q, flat_k[:start + n], flat_v[:start + n], start)
    assert out.shape == (n, h, d)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_batched_decode_with_padding_equals_each_request_alone():
    h, n_kv, d = 6, 2, 16
    k_cache, v_cache = _cache(16, n_kv, d, torch.float32, seed=3)
    tables = [[4, 9, 1], [7], [2, 3, 5, 11]]
    lens = [10, 3, 16]
    nmax = max(map(len, tables))
    meta = att.AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=3,
        decode_block_tables=torch.tensor([t + [0] * (nmax - len(t)) for t in tables]),
        decode_mask=torch.arange(nmax * BS)[None, :] < torch.tensor(lens)[:, None], prefills=[])
    q = torch.randn(3, h, d, generator=torch.Generator().manual_seed(4))
    out = TorchReferenceBackend._decode(q, k_cache, v_cache, meta, d ** -0.5)
    for i, (t, n) in enumerate(zip(tables, lens)):
        kc = k_cache[t].reshape(-1, n_kv, d)[:n]
        vc = v_cache[t].reshape(-1, n_kv, d)[:n]
        ref = _masked_reference(q[i:i + 1], kc, vc, n - 1)[0]
        torch.testing.assert_close(out[i].double(), ref, atol=2e-6, rtol=1e-5)
