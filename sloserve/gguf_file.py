"""A GGUF file's header read once: its metadata key/values and tensor table, or in words what is
wrong with it.

One walk over the layout (header, metadata key/values, tensor table, then the aligned tensor data;
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with ``struct`` on a memory map, in
either byte order. It is what the API process reads a GGUF tokenizer from (no torch, no numpy:
pass ``tensors=False``) and what the weights' loader takes the config and the tensor table from;
tensor data is never read here. A truncated or corrupt file raises :class:`GGUFError` whose
message says where the file ends early, which field is corrupt, or which tensor type is unknown;
the tensor types' block sizes come from the ``gguf`` package (imported only for the table).

A vocabulary of 49,152 tokens is read in ~40 ms; ``gguf.GGUFReader`` builds a numpy view per
field part and took ~2 s on the same file.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

_HEADER = 24  # magic, version (u32), tensor count (u64), metadata key/value count (u64)
_MAGIC = b"GGUF"
#: more metadata keys or tensors than any real file has (a few dozen keys, a few thousand
#: tensors): a count above it is corruption, not a model (a truncated file keeps its counts)
_MAX_COUNT = 2 ** 24
#: more bytes than one metadata value takes in any real file (the largest, a vocabulary, is a
#: few MB); a truncated file cuts values short but never makes them claim more
_MAX_ITEM = 2 ** 32
#: GGUF metadata value types of a fixed size -> struct code (8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFError(ValueError):
    """The first problem found in a GGUF file; the message is the phrase alone (``"truncated:
    the file ends at byte 20, inside the header"``), the caller names the file."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the GGUF tensor table.

    Attributes:
        name: llama.cpp tensor name, e.g. ``blk.0.attn_q.weight``.
        shape: torch-order shape (ggml's ``[ne0, ne1]`` reversed to ``(ne1, ne0)``), elements.
        ggml_type: ``gguf.GGMLQuantizationType`` value of the stored encoding.
        offset: byte offset of the tensor data from the start of the file.
        nbytes: bytes the tensor occupies in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """What :func:`read_gguf_header` read.

    Attributes:
        path: absolute path of the file.
        version: GGUF version (2 or 3).
        byte_order: ``"<"`` (little-endian) or ``">"``.
        metadata: every key/value: numbers, bools, strings, lists of them (lists of lists for
            arrays of arrays).
        tensors: the tensor table in file order, keyed by name (empty when not asked for).
        size: the file's size in bytes.
    """

    path: str
    version: int
    byte_order: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)
    size: int = 0


class _Walk:
    def __init__(self, buf, order: str):
        self.buf, self.size, self.order, self.pos = buf, len(buf), order, 0

    def need(self, n: int, what: str) -> None:
        if n > _MAX_ITEM:
            raise GGUFError(f"corrupt: {what} claims {n} bytes")
        if self.pos + n > self.size:
            raise GGUFError(f"truncated: the file ends at byte {self.size}, inside {what}")

    def take(self, code: str, what: str):
        n = struct.calcsize(code)
        self.need(n, what)
        v = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.take("Q", what)
        start = self.pos
        self.need(n, what)
        self.pos += n
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"corrupt: {what} (at byte {start}) is not UTF-8 text") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings (a vocabulary, a merge table): the loop of :meth:`string` inlined."""
        if count > _MAX_ITEM // 8:
            raise GGUFError(f"corrupt: {what} claims {count} entries")
        buf, size, pos, out = self.buf, self.size, self.pos, []
        length = struct.Struct(self.order + "Q").unpack_from
        append = out.append
        try:
            for _ in range(count):
                (n,) = length(buf, pos)
                end = pos + 8 + n
                if end > size:
                    break
                append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except struct.error:  # fewer than 8 bytes left for a length
            pass
        except UnicodeDecodeError:
            raise GGUFError(f"corrupt: {what} (at byte {pos + 8}) is not UTF-8 text") from None
        self.pos = pos
        if len(out) < count:  # stopped early: say why, as the one-string walk would
            self.string(what)
        return out

    def value(self, vtype: int, what: str):
        if vtype == _STRING:
            return self.string(what)
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], what)
        if vtype == _ARRAY:
            itype, count = self.take("I", what), self.take("Q", what)
            if itype in _SCALARS:
                width = struct.calcsize(_SCALARS[itype])
                self.need(count * width, what)
                out = list(struct.unpack_from(f"{self.order}{count}{_SCALARS[itype]}",
                                              self.buf, self.pos))
                self.pos += count * width
                return out
            if itype == _STRING:
                return self.strings(count, what)
            if itype == _ARRAY:
                if count > _MAX_ITEM // 8:
                    raise GGUFError(f"corrupt: {what} claims {count} entries")
                return [self.value(itype, what) for _ in range(count)]
            raise GGUFError(f"corrupt: {what} is an array of unknown value type {itype}")
        raise GGUFError(f"corrupt: {what} has an unknown value type {vtype}")


def read_gguf_header(path: str | os.PathLike, tensors: bool = True) -> GGUFHeader:
    """Read the header of the GGUF file at ``path``: its metadata, and with ``tensors`` its
    tensor table checked against the file's size (every tensor's data inside the file).

    Raises:
        FileNotFoundError / OSError: the file cannot be opened.
        GGUFError: not a GGUF file, an unsupported version, a truncated or corrupt header, a
            tensor of an unknown type or of rows that are not whole blocks, tensor data past
            the end of the file.
    """
    path = os.path.abspath(os.fspath(path))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFError("the file is empty (0 bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read(buf, path, size, tensors)


def gguf_problem(path: str | os.PathLike) -> str | None:
    """The first structural problem of the GGUF file at ``path`` (the :class:`GGUFError`
    phrase), or None when its header and tensor table are sound or it cannot be opened (the
    caller's own error says why)."""
    try:
        read_gguf_header(path)
    except GGUFError as e:
        return str(e)
    except Exception:  # unreadable, or a walker bug: never hide the caller's own error
        return None
    return None


def _read(buf, path: str, size: int, tensors: bool) -> GGUFHeader:
    head = bytes(buf[:4])
    if head != _MAGIC and not (size < 4 and _MAGIC.startswith(head)):
        raise GGUFError(f"it does not start with the GGUF magic bytes (found {head!r})")
    if size < 8:
        raise GGUFError(f"truncated: the file ends at byte {size}, inside the {_HEADER}-byte "
                        f"header")
    version = struct.unpack_from("<I", buf, 4)[0]
    order = "<"
    if version & 0xFFFF == 0:  # written big-endian (as llama.cpp's reader detects it)
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
    w = _Walk(buf, order)
    w.pos = 8
    n_tensors, n_kv = w.take("Q", "the header"), w.take("Q", "the header")
    for n, what in ((n_kv, "metadata keys"), (n_tensors, "tensors")):
        if n > _MAX_COUNT:
            raise GGUFError(f"corrupt: the header claims {n} {what}")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = w.string(f"the name of metadata key {i + 1} of {n_kv}")
        metadata[key] = w.value(w.take("I", f"metadata key {key!r}"),
                                f"the value of metadata key {key!r}")
    out = GGUFHeader(path, version, order, metadata, size=size)
    if tensors:
        alignment = metadata.get("general.alignment")
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            alignment = _DEFAULT_ALIGNMENT
        out.tensors = _tensor_table(w, n_tensors, alignment)
    return out


def _tensor_table(w: _Walk, n_tensors: int, alignment: int) -> dict[str, GGUFTensorInfo]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    table = []
    for j in range(n_tensors):
        name = w.string(f"the name of tensor {j + 1} of {n_tensors}")
        what = f"the description of tensor {name!r}"
        n_dims = w.take("I", what)
        if not 1 <= n_dims <= 8:
            raise GGUFError(f"corrupt: tensor {name!r} claims {n_dims} dimensions")
        dims = [w.take("Q", what) for _ in range(n_dims)]
        code = w.take("I", what)
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise GGUFError(f"unsupported quantization type: tensor {name!r} is stored as GGML "
                            f"type {code}, which gguf {gguf_version()} does not know") from None
        offset = w.take("Q", what)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(f"corrupt: tensor {name!r} has rows of {dims[0]} elements, not "
                            f"whole {block}-element {qtype.name} blocks")
        table.append((name, tuple(reversed(dims)), code, offset,
                      math.prod(dims) // block * type_size))
    data_start = w.pos + (-w.pos % alignment)
    infos = {name: GGUFTensorInfo(name, shape, code, data_start + offset, nbytes)
             for name, shape, code, offset, nbytes in table}
    if len(infos) < len(table):
        seen: set[str] = set()
        twice = next(t[0] for t in table if t[0] in seen or seen.add(t[0]))
        raise GGUFError(f"corrupt: two tensors are named {twice!r}")
    if infos:
        end, name = max((t.offset + t.nbytes, t.name) for t in infos.values())
        if end > w.size:
            raise GGUFError(f"truncated: tensor data runs to byte {end} (tensor {name!r}), but "
                            f"the file ends at byte {w.size}")
    return infos


def gguf_version() -> str:
    """The installed ``gguf`` package's version ("?" if unknown)."""
    try:
        from importlib.metadata import version
        return version("gguf")
    except Exception:  # pragma: no cover - metadata missing
        return "?"
