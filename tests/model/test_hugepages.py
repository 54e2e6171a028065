"""Tensors on 2 MB pages: zero-filled, the right shape and dtype, writable, alive after the
mapping's last Python reference is gone; pack copies values exactly onto aligned starts."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from sloserve.model import hugepages


@pytest.mark.parametrize("shape,dtype", [((3, 5), torch.float32), ((2, 7, 16, 3, 64), torch.bfloat16),
                                         ((5 << 20,), torch.int8), ((0, 4), torch.float32)])
def test_zeros_is_a_zero_filled_writable_tensor(shape, dtype):
    t = hugepages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    gc.collect()  # the mapping lives as long as the tensor
    t.fill_(3)
    assert (t == 3).all()
    if t.numel() and hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0


def test_pack_copies_exactly_onto_cache_line_starts():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(3, 5, generator=g), torch.randint(0, 255, (7,), dtype=torch.uint8),
          torch.randn(65, generator=g).bfloat16(), torch.empty(0)]
    out = hugepages.pack(ts)
    for a, b in zip(ts, out):
        assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert b.data_ptr() % 64 == 0 or b.numel() == 0
    out[0].fill_(0)  # copies: the sources are untouched
    assert ts[0].abs().sum() > 0
    # the one buffer they live in (what a decode instance's prewarm reads): every copy in it
    buf = hugepages.buffer_of(out[1])
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert all(lo <= b.data_ptr() and b.data_ptr() + b.numel() * b.element_size() <= hi
               for b in out if b.numel())
    for v in (77, 78):  # the same memory, not a copy
        out[1][0] = v
        assert buf[out[1].data_ptr() - lo].item() == v


def test_zeros_takes_an_int_and_refuses_a_negative_dimension():
    assert hugepages.zeros(5, torch.float32).shape == (5,)
    with pytest.raises(ValueError, match="negative dimension"):
        hugepages.zeros((3, -1), torch.float32)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_populate_in_background_commits_the_pages_and_changes_no_byte():
    """The KV cache's memory is faulted in after start-up while steps may already write it:
    every page becomes resident, what was written stays, the rest reads zero."""
    ts = [hugepages.zeros((16 << 20,), torch.uint8, touch=False) for _ in range(3)]
    ts[1][12345] = 7  # a step's write before its page is populated
    before = _resident_bytes()
    th = hugepages.populate_in_background(ts)
    if th is not None:
        th.join()
    assert _resident_bytes() - before >= 40 << 20  # the ~46 MB not yet touched (>= 2 layers)
    assert int(ts[1][12345]) == 7 and int(ts[1].sum()) == 7
    assert not ts[0].any() and not ts[2].any()
