"""The KV connector's shared memory (``transport: shm``): one POSIX shared-memory segment per
transfer, which the sending side creates and fills and the receiving side maps and imports
from, and the host identity that says whether two instances can share one. No torch.

A segment's name starts with :data:`PREFIX` (``ls /dev/shm/sloserve-kv-*``). Its lifetime is
the connector's, not the resource tracker's: Python's ``SharedMemory`` registers each segment
it creates or maps with a tracker process that unlinks it (warning of a leak) when this
process exits, so :func:`_shared_memory` opts out (``track=False`` from Python 3.13; before,
the registration is withdrawn at once). The receiving side unlinks the name as soon as it has
mapped the segment, the sending side when the transfer ends in any way; a process killed
between the two (one round trip) leaves the segment in /dev/shm.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import sys
from multiprocessing import resource_tracker, shared_memory

#: every segment's name starts with this
PREFIX = "sloserve-kv-"
_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_-]{1,100}\Z")
_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_TRACK_PARAM = sys.version_info >= (3, 13)


def host_identity() -> str | None:
    """This host's boot id and the device of its /dev/shm: two processes with the same identity
    run on one kernel and see one /dev/shm (two containers with their own /dev/shm differ), so
    one can map the other's segments. None where there is no such thing (not Linux)."""
    try:
        with open(_BOOT_ID) as f:
            boot = f.read().strip()
        dev = os.stat("/dev/shm").st_dev
    except OSError:
        return None
    return f"{boot}/{dev}" if boot else None


def valid_name(name: object) -> bool:
    """``name`` is a segment name this connector makes (no path, the prefix)."""
    return isinstance(name, str) and _NAME.match(name) is not None


def prepare() -> None:
    """Start Python's resource tracker now (before 3.13 the first segment would start it,
    a process, in the middle of a transfer)."""
    if not _TRACK_PARAM:
        resource_tracker.ensure_running()


def _shared_memory(name: str, create: bool, size: int) -> shared_memory.SharedMemory:
    if _TRACK_PARAM:
        return shared_memory.SharedMemory(name, create, size, track=False)
    shm = shared_memory.SharedMemory(name, create, size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - see the module doc
    return shm


class Segment:
    """One transfer's segment, made by :meth:`create` (the sending side) or :meth:`attach` (the
    receiving side). ``buf``: its bytes, a writable memoryview. :meth:`unlink` removes the name
    (from any thread, any number of times); :meth:`close` unmaps it, from the one thread that
    reads or writes ``buf``, after its last use."""

    def __init__(self, shm: shared_memory.SharedMemory, nbytes: int):
        self._shm = shm
        self.name = shm.name
        self.nbytes = nbytes
        self.buf = shm.buf
        self._unlinked = False

    @classmethod
    def create(cls, nbytes: int) -> "Segment":
        """A new segment of ``nbytes`` (> 0), its memory reserved now. Raises OSError (ENOSPC:
        /dev/shm is too small; writing into an unreserved page past its size would kill this
        process with SIGBUS)."""
        while True:
            name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
            try:
                shm = _shared_memory(name, True, nbytes)
                break
            except FileExistsError:
                continue
        seg = cls(shm, nbytes)
        try:
            # its descriptor (SharedMemory keeps it open until close)
            os.posix_fallocate(shm._fd, 0, nbytes)  # noqa: SLF001
        except OSError:
            seg.close()
            seg.unlink()
            raise
        return seg

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "Segment":
        """Map the segment ``name`` made by :meth:`create` (at least ``nbytes`` long). Raises
        OSError (FileNotFoundError: gone, or not in this /dev/shm)."""
        seg = cls(_shared_memory(name, False, 0), nbytes)
        if seg._shm.size < nbytes:
            seg.close()
            raise OSError(errno.EINVAL, f"shared memory {name} has {seg._shm.size} bytes, "
                                        f"not {nbytes}")
        return seg

    def unlink(self) -> None:
        """Remove the name (the memory goes with the last mapping)."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            if _TRACK_PARAM:
                self._shm.unlink()
            else:  # SharedMemory.unlink would withdraw the registration a second time
                shared_memory._posixshmem.shm_unlink(self._shm._name)  # noqa: SLF001
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unmap. A memoryview of ``buf`` still alive keeps the mapping until it goes."""
        self.buf = None
        try:
            self._shm.close()
        except BufferError:
            pass
