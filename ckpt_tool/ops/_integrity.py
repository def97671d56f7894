"""Integrity checks of ``validate`` (I/O), in one sequential pass over each data file.

* Every ``torch.save`` archive the checkpoint stores -- each DCP item of a ``.distcp`` file,
  each whole Megatron-LM legacy rank file / torch.save file -- has the CRC32 of every zip
  record checked (``torch.load`` does not), over a read-only mmap; the records are parsed by
  ``formats._dcp_raw`` (no copies). Archives it cannot follow go through ``zipfile``
  (:func:`check_zip_item`) for the verdict and its message.
* With ``deep``, the same pass counts NaN/Inf of every tensor chunk on its zero-copy view,
  slab by slab right after the slab's CRC (while it is in cache); chunks it cannot read in
  place are left to the reader (``validate._deep``).
* ``integrity.json`` sha256 digests.

Files (and runs of items of big files) are spread over worker threads: zlib and torch release
the GIL, so the pass runs at memory bandwidth rather than at one core's CRC speed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_tool.formats._dcp_raw import (NotSimple, ZipRecord, as_tensor, count_nonfinite,
                                        nonfinite, raw_item, zip_records)
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops._checks import Finding, error, warning

__all__ = ["BoundedReader", "check_zip_item", "scan_archives", "check_integrity_json"]

_ZIP_LAYOUTS = ("torch_save", "flat")
_WHOLE_FILE_FORMATS = ("legacy", "torch_save")
_BLOCK = 1 << 20
_SLAB = 4 << 20  # CRC and NaN/Inf counting alternate on slabs this big
_UNIT_BYTES = 256 << 20  # a big file's items are split into runs of about this many bytes
_MAX_WORKERS = 16


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


@dataclass(frozen=True)
class _Archive:
    """A torch.save archive at ``[offset, offset+length)``: a DCP item (``what`` = "chunk
    [..]" or "object") or a whole file (``what`` = "file"); ``count``: deep-count the tensor
    of this DCP item for ``key`` (it must hold ``numel`` elements)."""

    offset: int
    length: int
    key: str | None
    what: str
    count: bool = False
    numel: int = -1


@dataclass(frozen=True)
class _Raw:
    """A chunk stored as plain little-endian elements inside a whole-file archive (legacy)."""

    offset: int
    length: int
    dtype: str
    key: str


@dataclass
class _Unit:
    file: str
    archives: list[_Archive] = field(default_factory=list)
    raws: list[_Raw] = field(default_factory=list)
    count_raws: bool = False


@dataclass
class _Out:
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, list[int]] = field(default_factory=dict)  # key -> [nan, inf, chunks]
    uncounted: set[str] = field(default_factory=set)
    checked: int = 0

    def add(self, key: str, nan: int, inf: int) -> None:
        c = self.counts.setdefault(key, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + nan, c[1] + inf, c[2] + 1


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _plan(meta: CheckpointMeta, sizes: dict[str, int | None], skip_objects: set[str],
          deep: bool) -> list[_Unit]:
    whole = meta.format in _WHOLE_FILE_FORMATS
    files: dict[str, _Unit] = {}
    for key, t in meta.tensors.items():
        for c in t.chunks:
            if not c.file or c.transforms or c.byte_offset is None or c.byte_length is None:
                continue
            if whole and c.layout == "raw":
                files.setdefault(c.file, _Unit(c.file, count_raws=deep)).raws.append(
                    _Raw(c.byte_offset, c.byte_length, t.dtype, key))
            elif not whole and c.layout in _ZIP_LAYOUTS:
                files.setdefault(c.file, _Unit(c.file)).archives.append(_Archive(
                    c.byte_offset, c.byte_length, key, f"chunk {_box(c.offsets, c.sizes)}",
                    deep, c.numel))
    for o in meta.objects:
        if not o.file:
            continue
        if whole:
            files.setdefault(o.file, _Unit(o.file, count_raws=deep))
        elif o.unique_key not in skip_objects and o.byte_offset is not None \
                and o.byte_length is not None:
            files.setdefault(o.file, _Unit(o.file)).archives.append(
                _Archive(o.byte_offset, o.byte_length, o.unique_key, "object"))
    units = []
    for name in sorted(files):
        u, size = files[name], sizes.get(name)
        if size is None:
            continue  # reported by check_storage
        if whole:
            u.archives.append(_Archive(0, size, None, "file"))
            units.append(u)
            continue
        u.archives.sort(key=lambda a: a.offset)
        run: list[_Archive] = []
        run_bytes = 0
        for a in u.archives:
            run.append(a)
            run_bytes += a.length
            if run_bytes >= _UNIT_BYTES:
                units.append(_Unit(name, run))
                run, run_bytes = [], 0
        if run:
            units.append(_Unit(name, run))
    return units


def _crc_and_count(rec: memoryview, span: tuple[int, int], dtype: str, out: list[int]) -> int:
    """CRC32 of ``rec``; NaN/Inf of the elements in its byte range ``span`` added to ``out``."""
    crc = 0
    a, b = span
    for s in range(0, len(rec), _SLAB):
        with rec[s:s + _SLAB] as part:
            crc = zlib.crc32(part, crc)
            lo, hi = max(s, a), min(s + len(part), b)
        if lo < hi:
            with rec[lo:hi] as data:
                n, i = count_nonfinite(data, dtype)
            out[0] += n
            out[1] += i
    return crc


def _count_raw(data: memoryview, dtype: str) -> tuple[int, int]:
    nan = inf = 0
    for s in range(0, len(data), _SLAB):
        with data[s:s + _SLAB] as part:
            n, i = count_nonfinite(part, dtype)
        nan, inf = nan + n, inf + i
    return nan, inf


def _bad_crc(rec: ZipRecord, got: int) -> str:
    return f"Bad CRC-32 for file {rec.name!r} (computed {got:08x}, recorded {rec.crc:08x})"


def _check_archive(f: Any, item: memoryview, a: _Archive, u: _Unit, out: _Out) -> None:
    out.checked += 1
    where = f"{a.what} at bytes [{a.offset}, {a.offset + a.length})"
    try:
        records = zip_records(item)
        if not records or not all(r.stored for r in records):
            raise NotSimple("compressed records")
    except NotSimple:
        if a.count:
            out.uncounted.add(str(a.key))
        if a.what == "file" and not zipfile.is_zipfile(f):
            return  # a legacy (non-zip) torch.save file or a truncated one: the reader says
        why = check_zip_item(f, a.offset, a.length)
        if why is not None:
            out.findings.append(error(f"{where}: {why}", key=a.key, file=u.file))
        return
    raw = span = None
    if a.count:
        try:
            raw = raw_item(item, records)
            if raw.numel == a.numel:
                span = raw.dense_span()
            else:
                raw = None  # the reader reports the mismatch
        except NotSimple:
            raw = None
    counts = [0, 0]
    try:
        for r in records:
            with item[r.start:r.start + r.size] as rec:
                if raw is not None and span is not None and r is raw.record:
                    crc = _crc_and_count(rec, (span[0] * raw.itemsize, span[1] * raw.itemsize),
                                         raw.dtype, counts)
                else:
                    crc = zlib.crc32(rec)
            if crc == r.crc:
                continue
            if a.what != "file":
                out.findings.append(error(f"{where}: damaged torch.save archive "
                                          f"({_bad_crc(r, crc)})", key=a.key, file=u.file))
                return
            keys = sorted({x.key for x in u.raws if r.start <= x.offset < r.start + r.size})
            out.findings.append(error(
                f"zip record {r.name} at bytes [{r.start}, {r.start + r.size}): damaged "
                f"torch.save archive ({_bad_crc(r, crc)})", key=keys[0] if keys else None,
                file=u.file))
        if a.count and raw is None:
            out.uncounted.add(str(a.key))
        elif raw is not None:
            if span is None:  # a strided view that skips or repeats storage elements
                t = as_tensor(raw)
                counts = list(nonfinite(t))
                del t
            out.add(str(a.key), counts[0], counts[1])
    finally:
        if raw is not None:
            try:
                raw.data.release()
            except BufferError:
                pass


def _scan_unit(base: Path, u: _Unit, size: int) -> _Out:
    out = _Out()
    try:
        f = open(base / u.file, "rb")
    except OSError as exc:
        out.findings.append(error(f"cannot open data file ({exc.strerror})", file=u.file))
        return out
    with f:
        if size == 0:
            return out
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        view = memoryview(mapped)
        try:
            for a in u.archives:
                if 0 <= a.offset and a.offset + a.length <= size:  # else: check_storage
                    with view[a.offset:a.offset + a.length] as item:
                        _check_archive(f, item, a, u, out)
            for r in u.raws if u.count_raws else ():
                if r.offset < 0 or r.offset + r.length > size:
                    out.uncounted.add(r.key)
                    continue
                with view[r.offset:r.offset + r.length] as data:
                    out.add(r.key, *_count_raw(data, r.dtype))
        finally:
            view.release()
            try:
                mapped.close()
            except BufferError:
                pass
    return out


def _workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, n))


def scan_archives(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
                  stats: dict[str, int], skip_objects: set[str], *, deep: bool = False
                  ) -> tuple[list[Finding], dict[str, tuple[int, int]]]:
    """CRC32 findings of every torch.save archive of a DCP-based or legacy/torch.save
    checkpoint and, with ``deep``, ``{key: (NaN, Inf)}`` for every tensor whose chunks were
    all counted in place (the others are for the reader). Sets ``stats["zip_items_checked"]``.
    """
    units = _plan(meta, sizes, skip_objects, deep)
    workers = min(_workers(), len(units))
    results: list[_Out] = []
    torch_threads = None
    try:
        if workers > 1:
            if deep:
                import torch

                torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)  # the workers are the parallelism
            with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-scan") as pool:
                results = list(pool.map(
                    lambda u: _scan_unit(base, u, int(sizes[u.file] or 0)), units))
        else:
            results = [_scan_unit(base, u, int(sizes[u.file] or 0)) for u in units]
    finally:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
    findings: list[Finding] = []
    counts: dict[str, list[int]] = {}
    uncounted: set[str] = set()
    for r in results:
        findings.extend(r.findings)
        uncounted |= r.uncounted
        for k, (n, i, c) in r.counts.items():
            acc = counts.setdefault(k, [0, 0, 0])
            acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + i, acc[2] + c
    stats["zip_items_checked"] = sum(r.checked for r in results)
    counted = {k: (n, i) for k, (n, i, c) in counts.items()
               if k not in uncounted and c == len(meta.tensors[k].chunks)}
    return findings, counted


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
