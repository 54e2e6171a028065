"""Tensors on 2 MB pages (Linux transparent huge pages), for the memory a step streams: the KV
cache and the quantized weights.

A decode step reads ~100 MB of weights and, at 16 requests of 256 tokens, ~95 MB of KV cache
(the embedded model). On 4 KB pages that is ~50,000 pages per step, far more than the TLB
holds: every new page costs a page walk. The memory here is an anonymous private mapping
advised ``MADV_HUGEPAGE`` before anything touches it, so the kernel backs it with 2 MB pages
where it can (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise`` or ``always``).
Measured on the Zen 5 host, weights and cache copied onto 2 MB pages vs as torch allocated them,
steps alternated in one process: 1 decode 3.87 -> 3.76 ms, 16 decodes at context 256 9.87 ->
9.45 ms, at 1,024 16.9 -> 16.3 ms. Where the kernel says no (THP ``never``, another OS) the
memory is ordinary pages: same numbers, same speed as before.
"""
from __future__ import annotations

import ctypes
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
#: madvise(2) advice that faults pages in writable without changing them (Linux 5.14)
_MADV_POPULATE_WRITE = 23
_MADV_DONTNEED = 4
_ALIGN = 64  # each packed tensor starts on a cache line


def zeros(shape, dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
    """A zero-filled contiguous tensor on 2 MB pages where the OS allows it (torch.zeros where
    this Python has no ``madvise``). Its memory is written once here, so that it is committed
    now, as torch.zeros commits it: a machine short of memory fails at start-up, not in the
    middle of serving. ``touch=False``: not written here (the OS's pages are zero already),
    for a caller that writes all of it next (:func:`pack`: an 8B model's 5.5 GB once, not
    twice)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"hugepages.zeros: negative dimension in {list(shape)}")
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    off = -addr % HUGE_PAGE
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, off, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    except OSError:  # the kernel has no THP: ordinary pages
        pass
    # the tensor keeps the mapping alive (torch.frombuffer holds the buffer)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off)
    if touch:
        t.zero_()
    return t.view(dtype).view(shape)


def populate_in_background(tensors: list[torch.Tensor]) -> threading.Thread | None:
    """Commit the memory of ``tensors`` (from :func:`zeros` with ``touch=False``) on a daemon
    thread: ``madvise(MADV_POPULATE_WRITE)`` faults every page in writable and changes no byte,
    so steps may write the tensors meanwhile. A 1 GiB KV cache takes 0.3-1.3 s to fault in on
    2 MB pages (the kernel zeroes and compacts them), which start-up no longer waits for.
    Where the kernel has no such advice (before 5.14, or no ``madvise``) the tensors are
    written here, now, as :func:`zeros` would have. Returns the thread, or None."""
    ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]
    if ranges and not _madvise(*ranges[0], _MADV_POPULATE_WRITE):
        for t in tensors:
            t.zero_()
        return None

    def run(keep=tensors) -> None:  # ``keep``: the tensors stay mapped while it runs
        for addr, n in ranges[1:]:
            _madvise(addr, n, _MADV_POPULATE_WRITE)
    th = threading.Thread(target=run, name="kv-populate", daemon=True)
    th.start()
    return th


class Prefault:
    """A buffer of ``nbytes`` (a bound on what will be written into it) from :func:`zeros`
    (``touch=False``), its pages faulted in on a daemon thread from now on
    (``MADV_POPULATE_WRITE``), for a caller that knows the bound long before it has the data: the
    model loader takes the GGUF file's size as the bound on its packed weights, so that the
    kernel's zeroing and compaction of their 2 MB pages (0.1-0.9 s for a 1B model's 0.7 GB on a
    Zen 4 host, more the fuller the page cache) overlaps the file's decoding instead of following
    it. Where the kernel has no such advice the pages fault at first write, as without it."""

    def __init__(self, nbytes: int):
        self.buf: torch.Tensor | None = zeros((max(int(nbytes), 1),), torch.uint8, touch=False)
        def run(keep=self.buf) -> None:  # ``keep``: the buffer stays mapped while it runs
            _madvise(keep.data_ptr(), keep.numel(), _MADV_POPULATE_WRITE)
        self._thread = threading.Thread(target=run, name="weights-populate", daemon=True)
        self._thread.start()

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The buffer's first ``nbytes`` (uint8) once its faulting is done, the rest of its
        pages given back; None (and the buffer dropped) where it is smaller. Once only."""
        self._thread.join()
        buf, self.buf = self.buf, None
        if buf is None or buf.numel() < nbytes:
            return None
        tail = -(-(buf.data_ptr() + nbytes) // HUGE_PAGE) * HUGE_PAGE  # the next 2 MB page
        end = buf.data_ptr() + buf.numel()
        if end > tail:
            _madvise(tail, end - tail, _MADV_DONTNEED)
        return buf[:nbytes]

    def release(self) -> None:
        """Drop the buffer (not taken: nothing was packed into it)."""
        self.take(1 << 62)


def _madvise(addr: int, n: int, advice: int) -> bool:
    """madvise(2) over [addr, addr + n) widened to whole pages; False where it fails."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = addr - addr % mmap.PAGESIZE
    return fn(start, addr + n - start, advice) == 0  # ctypes lets go of the GIL


def packed_size(t: torch.Tensor) -> int:
    """The bytes ``t`` takes in a :func:`pack` buffer (its own, rounded up to 64)."""
    return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN


def copy_into(buf: torch.Tensor, offset: int, t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` at byte ``offset`` of ``buf`` (uint8), as a view of ``t``'s shape."""
    v = buf[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v


def pack(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (any dtypes and shapes) in one buffer on 2 MB pages, each starting
    on a 64-byte boundary; contiguous, the same values."""
    buf = zeros((max(sum(packed_size(t) for t in tensors), 1),), torch.uint8, touch=False)
    out, o = [], 0
    for t in tensors:
        out.append(copy_into(buf, o, t))
        o += packed_size(t)
    return out


def buffer_of(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer (bytes) a view from :func:`pack` or :func:`zeros` lives in."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
