"""Writing one tensor as a ``torch.save`` archive ourselves, byte for byte what torch writes.

A DCP ``.distcp`` item is ``torch.save(tensor)`` into the open file. Going through torch costs
a call into its C++ zip writer per item, which hands the bytes back to a Python stream in
pieces, computes the CRC with miniz and needs a torch tensor (so a byte-moving conversion would
have to import torch and copy each chunk into one). Here the same archive is produced from
the tensor's raw bytes (a ``memoryview``: a numpy array or a torch tensor's storage): a few
small header writes, one write of the data, the CRC by ISA-L. ``tests/formats`` compares our
archives with ``torch.save``'s byte for byte, over dtypes and shapes.

The layout torch 2.x writes for a tensor saved into a stream (records in this order, each
record's data aligned to 64 bytes of the archive by an extra field ``FB`` + length + ``Z``
padding; sizes and CRC in a data descriptor after the data, zero in the local header; method
*stored*, time and date zero; a ZIP64 end record always)::

    archive/data.pkl                  pickle (protocol 2) of _rebuild_tensor_v2(storage, ...)
    archive/.format_version           "1"
    archive/.storage_alignment        "64"
    archive/byteorder                 "little"
    archive/data/0                    the storage's bytes
    archive/version                   "3\\n"
    archive/.data/serialization_id    20 digits from the record names, then 20 from the CRCs

Archives of 4 GiB or more need ZIP64 fields in the headers; they, and dtypes whose pickle is
special (float8, uint16/32/64), are left to ``torch.save`` (:func:`supported` says which).
Nothing here imports torch.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Sequence

from ckpt_tool._crc import crc32

__all__ = ["STORAGE_TYPES", "supported", "tensor_pickle", "TensorArchive", "object_archive",
           "records_archive"]

#: dtype name -> the storage class ``torch.save`` names in ``data.pkl``
STORAGE_TYPES: dict[str, str] = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}

_PREFIX = "archive/"
_ALIGN = 64
_LOCAL = struct.Struct("<4s5H3L2H")
_DESCRIPTOR = struct.Struct("<4s3L")
_CDIR = struct.Struct("<4s6H3L5H2L")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")
_LOC64 = struct.Struct("<4sLQL")
_EOCD = struct.Struct("<4s4H2LH")
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_LIMIT = 0xFFFFFFFF - (1 << 16)  # below this every offset and size fits 32 bits
_SMALL = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_VERSION = b"3\n"
# torch derives the first half of serialization_id from the names of the records it wrote
# (the same names for every tensor archive), the second half from their CRCs (below)
_NAMES_ID = "15728199511854643026"
_OBJECT_NAMES_ID = "02908468677762923104"  # the same without data/0 (an object, no tensors)
_MASK = (1 << 64) - 1
_CD_CRC = 16  # the CRC's offset in a central directory entry


def supported(dtype: str, nbytes: int) -> bool:
    """True when :class:`TensorArchive` writes what ``torch.save`` would for such a tensor."""
    return dtype in STORAGE_TYPES and nbytes < _LIMIT


def _int(x: int) -> bytes:
    if 0 <= x < 256:
        return b"K" + bytes((x,))
    if 0 <= x < 65536:
        return b"M" + struct.pack("<H", x)
    if -(1 << 31) <= x < (1 << 31):
        return b"J" + struct.pack("<i", x)
    raw = x.to_bytes((x.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes((len(raw),)) + raw


def _text(s: str) -> bytes:
    raw = s.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(values: Sequence[int], memo: int) -> tuple[bytes, int]:
    """A tuple of ints as pickle protocol 2 writes it, and the next memo index."""
    if not values:
        return b")", memo
    body = b"".join(_int(v) for v in values)
    if len(values) <= 3:
        return body + b"\x85\x86\x87"[len(values) - 1:len(values)] + b"q" + bytes((memo,)), \
            memo + 1
    return b"(" + body + b"tq" + bytes((memo,)), memo + 1


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor (a size 0 counts as 1)."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(out))


def tensor_pickle(dtype: str, shape: Sequence[int]) -> bytes:
    """``data.pkl`` of ``torch.save`` of a contiguous, fresh tensor (storage ``0`` on the
    CPU, offset 0, no grad, no hooks)."""
    shape = tuple(int(s) for s in shape)
    head = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00((" + _text("storage") + b"q\x01"
            + b"ctorch\n" + STORAGE_TYPES[dtype].encode() + b"\nq\x02" + _text("0") + b"q\x03"
            + _text("cpu") + b"q\x04" + _int(math.prod(shape)) + b"tq\x05QK\x00")
    size, memo = _tuple(shape, 6)
    stride, memo = _tuple(contiguous_stride(shape), memo)
    tail = (b"\x89ccollections\nOrderedDict\nq" + bytes((memo,)) + b")Rq" + bytes((memo + 1,))
            + b"tq" + bytes((memo + 2,)) + b"Rq" + bytes((memo + 3,)) + b".")
    return head + size + stride + tail


def _flags(size: int) -> int:
    return _FLAGS if size else _FLAGS & ~0x0008  # an empty record: no data descriptor


def _combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK)) & _MASK


class _Records:
    """The zip records of one archive under ``prefix/``: local headers (64-byte aligned data,
    sizes in data descriptors), then the central directory and the ZIP64 end records."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.records: list[tuple[bytes, int, int, int]] = []  # name, header at, size, crc

    def local(self, out: bytearray, base: int, name: str, size: int) -> int:
        """Append a local header at archive offset ``base + len(out)``; return that offset."""
        full = (self.prefix + name).encode()
        at = base + len(out)
        pad = -(at + _LOCAL.size + len(full) + 4) % _ALIGN
        out += _LOCAL.pack(b"PK\x03\x04", 0, _flags(size), 0, 0, 0, 0, 0, 0, len(full),
                           pad + 4)
        out += full + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return at

    def record(self, out: bytearray, base: int, name: str, data: bytes) -> int:
        """Append the record; returns where its data starts in ``out``."""
        at = self.local(out, base, name, len(data))
        crc = crc32(data) & 0xFFFFFFFF
        start = len(out)
        out += data
        if data:  # an empty record has no data descriptor
            out += _DESCRIPTOR.pack(b"PK\x07\x08", crc, len(data), len(data))
        self.records.append(((self.prefix + name).encode(), at, len(data), crc))
        return start

    def finish(self, out: bytearray, base: int, names_id: str) -> dict[str, int]:
        """``version``, ``.data/serialization_id``, the central directory and end records;
        returns where in ``out`` the fields that depend on the CRCs are (for
        :class:`TensorArchive`'s template): ``"id"`` the serialization id's data, ``"id_crc"``
        its descriptor's CRC, ``"cd_<n>"`` the CRC in the central directory entry of the
        n-th record."""
        self.record(out, base, "version", _VERSION)
        combined = 0
        for _, _, size, c in self.records:
            if size:  # torch combines the CRCs of non-empty records only
                combined = _combine(combined, c)
        sid = f"{names_id}{combined:020d}".encode()
        at = {"id": self.record(out, base, ".data/serialization_id", sid)}
        at["id_crc"] = at["id"] + len(sid) + 4
        cd_start = base + len(out)
        for n, (full, at_, size, c) in enumerate(self.records):
            at[f"cd_{n}"] = len(out) + _CD_CRC
            out += _CDIR.pack(b"PK\x01\x02", 0, 0, _flags(size), 0, 0, 0, c, size, size,
                              len(full), 0, 0, 0, 0, 0, at_) + full
        end = base + len(out)
        n = len(self.records)
        out += _EOCD64.pack(b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, n, n, end - cd_start,
                            cd_start)
        out += _LOC64.pack(b"PK\x06\x07", 0, end, 1)
        out += _EOCD.pack(b"PK\x05\x06", 0, 0, n, n, end - cd_start, cd_start, 0)
        return at


def object_archive(pkl: bytes, prefix: str = "archive") -> bytes:
    """The ``torch.save`` archive of an object without tensors whose ``data.pkl`` is ``pkl``
    (the records are named ``prefix/...``: ``torch.save`` names them after the file, up to
    its first dot, or ``archive`` for a stream)."""
    return records_archive([("data.pkl", pkl), *_SMALL], _OBJECT_NAMES_ID, prefix)


def records_archive(records: Sequence[tuple[str, bytes]], names_id: str,
                    prefix: str = "archive") -> bytes:
    """A ``torch.save`` archive of ``records`` (names under ``prefix/``, in torch's order:
    ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/*``;
    ``version`` and ``.data/serialization_id`` are added), ``names_id`` the first half of
    its serialization id (a hash of the record names, taken from an archive of the same
    records)."""
    if sum(len(data) for _, data in records) >= _LIMIT:
        raise ValueError("no raw torch.save archive of 4 GiB or more")
    zf = _Records(prefix + "/")
    out = bytearray()
    for name, data in records:
        zf.record(out, 0, name, data)
    zf.finish(out, 0, names_id)
    return bytes(out)


class TensorArchive:
    """The ``torch.save`` archive of one tensor (archive offsets start at 0).

    ``head()`` is every byte before the tensor's data (it does not depend on the data);
    ``tail(crc)`` every byte after it, given the data's CRC-32. ``write`` does all three.
    Both come from a template made once per dtype, shape and size (layers repeat them):
    a tail is the template with the five fields that depend on the CRC filled in.
    """

    def __init__(self, dtype: str, shape: Sequence[int], nbytes: int):
        if not supported(dtype, nbytes):
            raise ValueError(f"no raw torch.save archive for {dtype} of {nbytes} bytes")
        self.nbytes = nbytes
        self._t = _template(dtype, tuple(int(s) for s in shape), nbytes)

    def head(self) -> bytes:
        """The bytes before the data."""
        return self._t.head

    def tail(self, crc: int) -> bytes:
        """The bytes after the data (``crc``: CRC-32 of the data)."""
        t = self._t
        out = bytearray(t.tail)
        combined = t.seed
        if self.nbytes:  # torch combines the CRCs of non-empty records only
            combined = _combine(combined, crc)
            _U32.pack_into(out, 4, crc)  # the data's descriptor
        combined = _combine(combined, t.version_crc)
        sid = f"{_NAMES_ID}{combined:020d}".encode()
        sid_crc = crc32(sid) & 0xFFFFFFFF
        out[t.sid:t.sid + len(sid)] = sid
        _U32.pack_into(out, t.sid_crc, sid_crc)
        _U32.pack_into(out, t.cd_data, crc)
        _U32.pack_into(out, t.cd_sid, sid_crc)
        return bytes(out)

    def write(self, write: Callable[..., Any], data: Any, *,
              writev: Callable[..., Any] | None = None, with_crcs: bool = False) -> int:
        """Write the archive of ``data`` (a buffer of ``nbytes`` bytes) through ``write``
        (or in one call of ``writev`` with the three parts); returns the archive's length.
        ``with_crcs``: each call also gets the CRC-32 of what it writes (``write(buf, crc)``,
        ``writev(bufs, crcs)``: ``ckpt_tool.digests.DigestedFile``), computed once here."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if view.nbytes != self.nbytes:
            raise ValueError(f"{view.nbytes} bytes of data for an archive of {self.nbytes}")
        head = self._t.head
        crc = crc32(view) & 0xFFFFFFFF
        tail = self.tail(crc)
        crcs = (self._t.head_crc, crc, crc32(tail) & 0xFFFFFFFF) if with_crcs else None
        if writev is not None:
            if crcs is None:
                writev([head, view, tail])
            else:
                writev([head, view, tail], crcs)
        elif crcs is None:
            write(head)
            if view.nbytes:
                write(view)
            write(tail)
        else:
            write(head, crcs[0])
            if view.nbytes:
                write(view, crcs[1])
            write(tail, crcs[2])
        return len(head) + view.nbytes + len(tail)


_U32 = struct.Struct("<L")


class _Template(NamedTuple):
    head: bytes
    tail: bytes  # with the data's CRC 0
    seed: int  # the CRCs of the records before data/0, combined
    version_crc: int
    sid: int  # where in the tail: the serialization id's data,
    sid_crc: int  # its descriptor's CRC,
    cd_data: int  # the CRC of data/0's central directory entry,
    cd_sid: int  # the CRC of the serialization id's entry
    head_crc: int  # the CRC-32 of ``head``


@lru_cache(maxsize=1024)
def _template(dtype: str, shape: tuple[int, ...], nbytes: int) -> _Template:
    head = bytearray()
    zf = _Records(_PREFIX)
    for name, data in (("data.pkl", tensor_pickle(dtype, shape)), *_SMALL):
        zf.record(head, 0, name, data)
    head_records = list(zf.records)
    data_at = zf.local(head, 0, "data/0", nbytes)
    seed = 0
    for _, _, size, c in head_records:
        if size:
            seed = _combine(seed, c)
    zf.records = [*head_records, ((_PREFIX + "data/0").encode(), data_at, nbytes, 0)]
    tail = bytearray(_DESCRIPTOR.pack(b"PK\x07\x08", 0, nbytes, nbytes) if nbytes else b"")
    at = zf.finish(tail, len(head) + nbytes, _NAMES_ID)
    n_data = len(head_records)
    return _Template(bytes(head), bytes(tail), seed, crc32(_VERSION) & 0xFFFFFFFF, at["id"],
                     at["id_crc"], at[f"cd_{n_data}"], at[f"cd_{n_data + 2}"],
                     crc32(bytes(head)) & 0xFFFFFFFF)
