"""What is wrong with a GGUF file that ``gguf.GGUFReader`` refused, in words.

The reader fails on a truncated or corrupt file with whatever numpy or ``struct`` raised
where it stopped ("cannot reshape array of size 67328 into shape (192,360)", "index 0 is out
of bounds"). :func:`gguf_problem` walks the same layout (header, metadata key/values, tensor
table; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with ``struct``, taking
the type codes and block sizes from the ``gguf`` package, and says where the file ends early,
which field is corrupt, or which tensor type is unknown. It never reads tensor data, and is
only called after the reader failed (a sound file is never walked twice).
"""
from __future__ import annotations

import math
import mmap
import os
import struct

_HEADER = 24  # magic, version (u32), tensor count (u64), metadata key/value count (u64)
#: more metadata keys or tensors than any real file has (a few dozen keys, a few thousand
#: tensors): a count above it is corruption, not a model (a truncated file keeps its counts)
_MAX_COUNT = 2 ** 24
#: more bytes than one metadata value takes in any real file (the largest, a vocabulary, is a
#: few MB); a truncated file cuts values short but never makes them claim more
_MAX_ITEM = 2 ** 32


class _Problem(Exception):
    """The first problem found (its message is the phrase :func:`gguf_problem` returns)."""


class _Walk:
    def __init__(self, buf, order: str):
        self.buf, self.size, self.order, self.pos = buf, len(buf), order, 0

    def need(self, n: int, what: str) -> None:
        if n > _MAX_ITEM:
            raise _Problem(f"corrupt: {what} claims {n} bytes")
        if self.pos + n > self.size:
            raise _Problem(f"truncated: the file ends at byte {self.size}, inside {what}")

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.take("Q", what)
        start = self.pos
        self.need(n, what)
        self.pos += n
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Problem(f"corrupt: {what} (at byte {start}) is not UTF-8 text") from None


def gguf_problem(path: str) -> str | None:
    """The first structural problem of the GGUF file at ``path``, or None if none is found.

    Returns:
        a phrase such as ``"truncated: tensor data runs to byte 98362432 (tensor
        'output_norm.weight'), but the file ends at byte 98358336"``, ``"corrupt: ..."``,
        ``"unsupported ..."``; None when the layout is sound (or the file cannot be opened:
        the caller's own error says why).
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size == 0:
                return "the file is empty (0 bytes)"
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _walk(buf)
    except _Problem as p:
        return str(p)
    except Exception:  # unreadable, or a walker bug: never hide the reader's own error
        return None
    return None


def _walk(buf) -> None:
    from gguf import (GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType,
                      GGUFValueType)

    magic, head = struct.pack("<I", GGUF_MAGIC), bytes(buf[:4])
    if head != magic and not (len(buf) < 4 and magic.startswith(head)):
        raise _Problem(f"it does not start with the GGUF magic bytes (found {head!r})")
    if len(buf) < 8:
        raise _Problem(f"truncated: the file ends at byte {len(buf)}, inside the "
                       f"{_HEADER}-byte header")
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<"
    if version & 0xFFFF == 0:  # written big-endian (as the reader detects it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise _Problem(f"unsupported GGUF version {version} (supported: 2, 3)")
    w = _Walk(buf, order)
    w.pos = 8
    n_tensors, n_kv = w.take("Q", "the header"), w.take("Q", "the header")
    for n, what in ((n_kv, "metadata keys"), (n_tensors, "tensors")):
        if n > _MAX_COUNT:
            raise _Problem(f"corrupt: the header claims {n} {what}")
    scalars = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
               GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
               GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
               GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d"}

    def value(vtype: int, what: str):
        if vtype == GGUFValueType.STRING:
            return w.string(what)
        if vtype in scalars:
            return w.take(scalars[vtype], what)
        if vtype == GGUFValueType.ARRAY:
            itype, count = w.take("I", what), w.take("Q", what)
            if itype in scalars:
                w.need(count * struct.calcsize(scalars[itype]), what)
                w.pos += count * struct.calcsize(scalars[itype])
            elif itype in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                if count > _MAX_ITEM // 8:
                    raise _Problem(f"corrupt: {what} claims {count} entries")
                for _ in range(count):
                    value(itype, what)
            else:
                raise _Problem(f"corrupt: {what} is an array of unknown value type {itype}")
            return None
        raise _Problem(f"corrupt: {what} has an unknown value type {vtype}")

    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = w.string(f"the name of metadata key {i + 1} of {n_kv}")
        v = value(w.take("I", f"metadata key {key!r}"), f"the value of metadata key {key!r}")
        if key == "general.alignment" and isinstance(v, int) and v > 0:
            alignment = v
    tensors = []
    for j in range(n_tensors):
        name = w.string(f"the name of tensor {j + 1} of {n_tensors}")
        what = f"the description of tensor {name!r}"
        n_dims = w.take("I", what)
        if not 1 <= n_dims <= 8:
            raise _Problem(f"corrupt: tensor {name!r} claims {n_dims} dimensions")
        dims = [w.take("Q", what) for _ in range(n_dims)]
        code = w.take("I", what)
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise _Problem(f"unsupported quantization type: tensor {name!r} is stored as GGML "
                           f"type {code}, which gguf {gguf_version()} does not know") from None
        offset = w.take("Q", what)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise _Problem(f"corrupt: tensor {name!r} has rows of {dims[0]} elements, not whole "
                           f"{block}-element {qtype.name} blocks")
        tensors.append((offset + math.prod(dims) // block * type_size, name))
    data_start = w.pos + (-w.pos % alignment)
    if tensors:
        end, name = max(tensors)
        if data_start + end > w.size:
            raise _Problem(f"truncated: tensor data runs to byte {data_start + end} (tensor "
                           f"{name!r}), but the file ends at byte {w.size}")


def gguf_version() -> str:
    """The installed ``gguf`` package's version ("?" if unknown)."""
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:  # pragma: no cover - metadata missing
        return "?"
