"""Integrity checks of ``validate`` (I/O): CRC32 of every zip entry of DCP items, read in
place through a bounded view of the data file, and ``integrity.json`` sha256 digests."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops._checks import Finding, error, warning

__all__ = ["BoundedReader", "check_zip_item", "check_zip_items", "check_integrity_json"]

_ZIP_LAYOUTS = ("torch_save", "flat")
_BLOCK = 1 << 20


class BoundedReader:
    """A read-only, seekable view of ``[offset, offset + length)`` of an open binary file,
    for ``zipfile`` to parse one DCP item in place (nothing is read into memory up front)."""

    def __init__(self, f: Any, offset: int, length: int):
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 1:
            pos += self._pos
        elif whence == 2:
            pos += self._len
        if pos < 0:
            raise OSError("negative seek position")
        self._pos = pos
        return pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._len - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        if n == 0:
            return b""
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def close(self) -> None:
        pass

    def flush(self) -> None:
        pass


def check_zip_item(f: Any, offset: int, length: int) -> str | None:
    """None if the torch.save archive at ``[offset, offset+length)`` of ``f`` is intact (every
    entry's CRC32 matches), else why not. Streams entries in 1 MiB blocks."""
    try:
        with zipfile.ZipFile(BoundedReader(f, offset, length)) as zf:
            infos = zf.infolist()
            if not infos:
                return "empty zip archive"
            for info in infos:
                with zf.open(info) as entry:
                    while entry.read(_BLOCK):
                        pass
    except zipfile.BadZipFile as exc:
        return f"damaged torch.save archive ({exc})"
    except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
        return f"unreadable torch.save archive ({type(exc).__name__}: {exc})"
    except Exception as exc:  # zlib.error and friends
        return f"unreadable torch.save archive ({type(exc).__name__}: {exc})"
    return None


_EOCD = struct.Struct("<4s4H2LH")
_CDIR = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")


def zip_item_intact(buf: memoryview) -> bool:
    """True when ``buf`` is a stored (uncompressed, non-ZIP64) zip archive whose every entry's
    CRC32 matches. False means "not proven": the caller falls back to ``check_zip_item`` for
    the verdict and its message. Parses the records with ``struct``; no copies of entry data."""
    tail = bytes(buf[-min(len(buf), 22 + 65535):])
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or len(tail) - at < _EOCD.size:
        return False
    _, _, _, _, count, _, cd_off, _ = _EOCD.unpack_from(tail, at)
    if count == 0 or count == 0xFFFF or cd_off == 0xFFFFFFFF:
        return False
    pos = cd_off
    for _ in range(count):
        if pos + _CDIR.size > len(buf):
            return False
        (sig, _, _, _, method, _, _, crc, csize, usize, nlen, elen, clen, _, _, _,
         lho) = _CDIR.unpack_from(buf, pos)
        if sig != b"PK\x01\x02" or method != 0 or csize != usize or 0xFFFFFFFF in (
                csize, lho):
            return False
        pos += _CDIR.size + nlen + elen + clen
        if lho + _LOCAL.size > len(buf):
            return False
        lsig, *_, lnlen, lelen = _LOCAL.unpack_from(buf, lho)
        start = lho + _LOCAL.size + lnlen + lelen
        if lsig != b"PK\x03\x04" or start + csize > len(buf):
            return False
        with buf[start:start + csize] as data:
            if zlib.crc32(data) != crc:
                return False
    return True


def check_zip_items(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
                     stats: dict[str, int], skip_objects: set[str]) -> list[Finding]:
    items: dict[str, list[tuple[int, int, str, str]]] = {}
    for key, t in meta.tensors.items():
        for c in t.chunks:
            if c.layout in _ZIP_LAYOUTS and not c.transforms and c.file \
                    and c.byte_offset is not None and c.byte_length is not None:
                box = "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(c.offsets, c.sizes)) + "]"
                items.setdefault(c.file, []).append((c.byte_offset, c.byte_length, key,
                                                     f"chunk {box}"))
    for o in meta.objects:
        if o.unique_key not in skip_objects and o.file and o.byte_offset is not None \
                and o.byte_length is not None:
            items.setdefault(o.file, []).append((o.byte_offset, o.byte_length, o.unique_key,
                                                 "object"))
    out: list[Finding] = []
    checked = 0
    for file in sorted(items):
        size = sizes.get(file)
        if size is None:
            continue  # reported by check_storage
        try:
            f = open(base / file, "rb")
        except OSError as exc:
            out.append(error(f"cannot open data file ({exc.strerror})", file=file))
            continue
        with f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            for off, length, key, what in sorted(items[file]):
                if off < 0 or off + length > size:
                    continue  # reported by check_storage
                with memoryview(mapped) as view, view[off:off + length] as item:
                    intact = zip_item_intact(item)
                why = None if intact else check_zip_item(f, off, length)
                checked += 1
                if why is not None:
                    out.append(error(f"{what} at bytes [{off}, {off + length}): {why}",
                                     key=key, file=file))
            if isinstance(mapped, mmap.mmap):
                mapped.close()
    stats["zip_items_checked"] = checked
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def check_integrity_json(root: Path) -> list[Finding]:
    f = root / "integrity.json"
    if not f.is_file():
        return []
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
        algo = doc.get("algorithm", "sha256")
        files = doc["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [error(f"unreadable integrity.json ({type(exc).__name__}: {exc})",
                      file="integrity.json")]
    if algo != "sha256":
        return [warning(f"integrity.json uses {algo!r}; only sha256 is checked",
                        file="integrity.json")]
    out = []
    for name, digest in sorted(files.items()):
        path = root / name
        if not path.is_file():
            out.append(error("file listed in integrity.json is missing", file=name))
            continue
        try:
            actual = _sha256(path)
        except OSError as exc:
            out.append(error(f"cannot read ({exc.strerror})", file=name))
            continue
        if actual != str(digest).lower():
            out.append(error(f"sha256 {actual[:16]}… does not match integrity.json "
                             f"({str(digest)[:16]}…)", file=name))
    return out
