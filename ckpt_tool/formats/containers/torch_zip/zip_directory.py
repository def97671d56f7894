"""The zip structure of a ``torch.save`` archive, read as PyTorch's own reader reads it.

``torch.load`` opens an archive with miniz (PyTorch's ``third_party/miniz-3.0.2``, driven by
``caffe2/serialize/inline_container.cc``). :func:`zip_records` parses the end records, the
central directory and the local headers with ``struct`` (no ``zipfile``, no copies of record
data) and applies every condition that reader applies on the way, each under an id (``Z``:
end records, ``C``: central directory entries, ``X``: a record's extraction, ``P``: PyTorch's
own checks; the list with what each tests is docs/formats.md §14):

* a condition that reader refuses raises :class:`TorchRejects` (``torch.load`` and so
  Megatron-Core's and DCP's loaders fail on such an archive);
* what the fast parser does not follow (no zip at all, a layout it does not know) raises
  :class:`NotSimple`: the caller asks ``zipfile`` (``archive_check.check_zip_item``) or
  ``torch.load`` for the verdict.

The checks are systematic rather than a list of damages met: a field miniz reads with a
condition is checked here with the same condition (miniz's quirks included, e.g. the stored
size check reading the method and the time field as one 32-bit value, a record of no
compressed bytes never having its local header read).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

__all__ = ["NotSimple", "TorchRejects", "ZipRecord", "zip_records", "entry_flags_problem",
           "version_problem", "MIN_VERSION", "MAX_VERSION"]

_EOCD = struct.Struct("<4s4H2LH")  # signature, disk, cd disk, entries here, entries, size, off
_LOC64 = struct.Struct("<4sLQL")  # signature, disk of the ZIP64 record, its offset, disks
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # signature, size, made by, needed, disk, cd disk, ...
_CDIR = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")
_MAX32 = 0xFFFFFFFF
_MAX16 = 0xFFFF
_FIXED64 = 56 - 12  # the ZIP64 end record's size field counts the record past its first 12
_ENCRYPTED = 0x1 | 0x20 | 0x40  # encrypted, compressed patch, strong encryption (X3)
_MASKED = 0x2000  # local header values masked (C7)
_DOS_DIR = 0x10
MIN_VERSION, MAX_VERSION = 1, 10  # the archive versions PyTorch 2.x reads (P4)


class NotSimple(Exception):
    """The archive is not in the plain layout the raw path reads; use ``torch.load``."""


class TorchRejects(NotSimple):
    """A zip structure PyTorch's archive reader (miniz, under ``torch.load``) refuses: the
    archive is damaged for every torch-based loader, whatever Python's ``zipfile`` says."""


class ZipRecord(NamedTuple):
    """One zip record: ``name``; its data at ``[start, start + size)`` of the archive when
    ``stored`` (uncompressed, unencrypted); ``crc`` the CRC32 the central directory records."""

    name: str
    start: int
    size: int
    crc: int
    stored: bool


def zip_records(buf: Any) -> list[ZipRecord]:
    """Every record of the zip archive ``buf`` (bytes or memoryview), in directory order;
    TorchRejects when PyTorch's reader refuses the archive, NotSimple when the structure
    cannot be followed (not a zip, ...)."""
    try:
        return _zip_records(buf)
    except struct.error as exc:
        raise NotSimple(f"damaged zip structure ({exc})") from None


def _find_end(buf: Any) -> int:
    """Where the end-of-central-directory record starts: the last signature with a whole
    record after it, searched in the last 64 KiB (Z1, Z2)."""
    n = len(buf)
    if n < _EOCD.size:
        raise NotSimple("too short for a zip archive")
    lo = max(0, n - (_MAX16 + _EOCD.size))
    at = bytes(buf[lo:]).rfind(b"PK\x05\x06", 0, n - lo - _EOCD.size + 4)
    if at < 0:
        raise NotSimple("no end-of-central-directory record")
    return lo + at


def _end_of_directory(buf: Any) -> tuple[int, int, int, int]:
    """``(entries, central directory offset, its size, this disk)`` as miniz takes them: the
    ZIP64 record's fields when a ZIP64 locator precedes the end record and points at one."""
    n = len(buf)
    at = _find_end(buf)
    _, disk, cd_disk, n_disk, count, cd_size, cd_off, _ = _EOCD.unpack_from(buf, at)
    loc = at - _LOC64.size
    if at >= _LOC64.size + _EOCD64.size and buf[loc:loc + 4] == b"PK\x06\x07":
        _, _, e64, disks = _LOC64.unpack_from(buf, loc)
        if e64 > n - _EOCD64.size:
            raise TorchRejects("Z3: the ZIP64 locator points past the archive")
        if buf[e64:e64 + 4] == b"PK\x06\x06":
            (_, size64, _, _, disk, cd_disk, n_disk, count, cd_size,
             cd_off) = _EOCD64.unpack_from(buf, e64)
            if size64 < _FIXED64:
                raise TorchRejects(f"Z4: the ZIP64 end record says it is {size64} bytes long")
            if disks != 1:
                raise TorchRejects(f"Z5: unsupported multidisk archive (the ZIP64 locator "
                                   f"says {disks} disks)")
            if count > _MAX32 or n_disk > _MAX32:
                raise TorchRejects(f"Z6: {max(count, n_disk)} entries (too many files)")
            if cd_size > _MAX32:
                raise TorchRejects(f"Z7: a central directory of {cd_size} bytes")
    if count != n_disk:
        raise TorchRejects(f"Z8: unsupported multidisk archive ({n_disk} of {count} entries "
                           "on this disk)")
    if (disk or cd_disk) and not (disk == 1 and cd_disk == 1):
        raise TorchRejects(f"Z9: unsupported multidisk archive (disk {disk}, central "
                           f"directory on disk {cd_disk})")
    if cd_size < count * _CDIR.size:
        raise TorchRejects(f"Z10: a central directory of {cd_size} bytes cannot hold "
                           f"{count} entries")
    if cd_off + cd_size > n:
        raise TorchRejects("Z11: the central directory runs past the archive")
    if count == 0:
        raise TorchRejects("P2: the archive holds no records")
    return count, cd_off, cd_size, disk


def _zip64_values(extra: bytes, want: list[bool], strict: bool) -> list[int | None]:
    """The values of the ZIP64 extended information field (id 1) of ``extra`` for the wanted
    fields (uncompressed size, compressed size, local header offset, in that order). Fields
    are walked as miniz walks them (C3); ``strict``: a wanted value missing from the field is
    an error too (X1: how a record is stat'ed before it is read)."""
    rem, pos = len(extra), 0
    while rem:
        if rem < 4:
            raise TorchRejects("C3: an extra field header runs past the entry's extra data")
        tag, size = struct.unpack_from("<HH", extra, pos)
        if size + 4 > rem:
            raise TorchRejects("C3: an extra field runs past the entry's extra data")
        if tag == 1:
            out: list[int | None] = []
            at, left = pos + 4, size
            for w in want:
                if not w:
                    out.append(None)
                elif left >= 8:
                    out.append(struct.unpack_from("<Q", extra, at)[0])
                    at, left = at + 8, left - 8
                elif strict:
                    raise TorchRejects("X1: the ZIP64 extra field lacks a value the entry "
                                       "defers to it")
                else:
                    out.append(None)
            return out
        pos, rem = pos + 4 + size, rem - 4 - size
    return [None] * len(want)


def entry_flags_problem(name: str, flags: int, method: int, disk: int, this_disk: int,
                        external: int) -> str | None:
    """Why PyTorch's reader refuses (or reads nothing of) a central directory entry, from
    the fields that do not depend on where the record lies (C5, C7, X2-X4); None if fine."""
    if disk == _MAX16 or (disk != this_disk and disk != 1):
        return f"C5: unsupported multidisk archive (entry {name!r} starts on disk {disk})"
    if flags & _MASKED:
        return f"C7: entry {name!r} has masked local header values (encryption)"
    if flags & _ENCRYPTED:
        return f"X3: entry {name!r} is encrypted or a patch (flags {flags:#06x})"
    if method not in (0, 8):
        return f"X4: entry {name!r} uses compression method {method} (unsupported)"
    if name.endswith("/") or external & _DOS_DIR:
        return f"X2: entry {name!r} is marked as a directory (torch reads no bytes of it)"
    return None


def _zip_records(buf: Any) -> list[ZipRecord]:
    n = len(buf)
    if n > 8 and bytes(buf[:8]) == b"PYTORCH1":
        raise TorchRejects("P1: an archive of PyTorch's preview release")
    count, cd_off, cd_size, this_disk = _end_of_directory(buf)
    cd = bytes(buf[cd_off:cd_off + cd_size])  # small; parsing bytes beats a memoryview
    out: list[ZipRecord] = []
    by_name: dict[str, ZipRecord] = {}
    pos = 0
    prefix = ""
    for _ in range(count):
        left = cd_size - pos
        if left < _CDIR.size or cd[pos:pos + 4] != b"PK\x01\x02":
            raise TorchRejects("C1: a central directory entry is missing or damaged")
        (_, _, _, flags, method, time, _, crc, csize, usize, nlen, elen, clen, disk, _,
         external, lho) = _CDIR.unpack_from(cd, pos)
        at = pos + _CDIR.size
        try:
            name = cd[at:at + nlen].decode("utf-8")
        except UnicodeDecodeError:  # torch.load lists the records as Python strings
            raise TorchRejects(f"P6: record name {cd[at:at + nlen][:40]!r} is not UTF-8") \
                from None
        deferred = [usize == _MAX32, csize == _MAX32, lho == _MAX32]
        if elen and any(deferred):  # C3 (miniz reads these from the archive, not the copy)
            extra = bytes(buf[cd_off + at + nlen:cd_off + at + nlen + elen])
            vals = _zip64_values(extra, deferred, strict=False)
            usize, csize, lho = (v if v is not None else d
                                 for v, d in zip(vals, (usize, csize, lho)))
        if csize != _MAX32 and usize != _MAX32 and (
                ((method | time << 16) == 0 and usize != csize) or (usize and not csize)):
            raise TorchRejects(f"C4: entry {name!r} holds {csize} bytes but says it "
                               f"holds {usize}")
        problem = entry_flags_problem(name, flags, method, disk, this_disk, external)
        if problem is not None and problem.startswith("C5"):
            raise TorchRejects(problem)
        if csize != _MAX32 and lho + _LOCAL.size + csize > n:
            raise TorchRejects(f"C6: entry {name!r} runs past the archive")
        if problem is not None and problem.startswith("C7"):
            raise TorchRejects(problem)
        if _CDIR.size + nlen + elen + clen > left:
            raise TorchRejects("C8: a central directory entry runs past the directory")
        if any(deferred):  # X1: stat'ed as miniz does before it reads the record
            _zip64_values(cd[at + nlen:at + nlen + elen], deferred, strict=True)
        if problem is not None:
            raise TorchRejects(problem)  # X2-X4: when torch reads the record
        pos = at + nlen + elen + clen
        if not out:
            if "/" not in name:
                raise TorchRejects(f"P3: first record {name!r} is not in the archive's "
                                   "directory")
            prefix = name.split("/", 1)[0] + "/"
        elif not name.startswith(prefix):
            raise TorchRejects(f"P5: record {name!r} is outside the archive's directory "
                               f"{prefix!r}")
        start = lho
        if csize:  # miniz never reads the local header of a record of no bytes (X2)
            if lho + _LOCAL.size > n:
                raise TorchRejects(f"X5: the local header of {name!r} is past the archive")
            local = _LOCAL.unpack_from(buf, lho)
            if local[0] != b"PK\x03\x04":
                raise TorchRejects(f"X5: the local header of {name!r} is damaged")
            start = lho + _LOCAL.size + local[9] + local[10]
            if start + csize > n:
                raise TorchRejects(f"X6: record {name!r} runs past the archive")
        rec = ZipRecord(name, start, usize, crc, method == 0 and csize == usize)
        out.append(rec)
        by_name[name.lower()] = rec
    _check_version(buf, by_name, prefix)
    return out


def _check_version(buf: Any, by_name: dict[str, ZipRecord], prefix: str) -> None:
    """P4: ``<archive>/.data/version`` (else ``<archive>/version``) exists and holds a
    version PyTorch reads."""
    rec = by_name.get(f"{prefix}.data/version".lower()) or by_name.get(f"{prefix}version".lower())
    if rec is None:
        raise TorchRejects("P4: the archive has no version record")
    if rec.stored:  # (compressed: torch.load decides)
        problem = version_problem(bytes(buf[rec.start:rec.start + rec.size]))
        if problem is not None:
            raise TorchRejects(problem)


def version_problem(data: bytes) -> str | None:
    """Why PyTorch refuses the content of a version record (P4: leading digits after
    optional blanks and a sign, parsed as ``std::stoull`` does, in its range), else None."""
    text = data.decode("latin-1").lstrip(" \t\n\v\f\r")
    sign = text[:1] if text[:1] in ("+", "-") else ""
    digits = ""
    for ch in text[len(sign):]:
        if ch not in "0123456789":
            break
        digits += ch
    if not digits:
        return f"P4: the version record holds {text[:16]!r}, not a number"
    value = -1 if sign == "-" else int(digits)  # stoull wraps a negative number: refused
    if not MIN_VERSION <= value <= MAX_VERSION:
        return f"P4: archive version {sign}{digits} (PyTorch reads {MIN_VERSION} to {MAX_VERSION})"
    return None
