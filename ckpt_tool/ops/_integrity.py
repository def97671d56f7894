"""Integrity checks of ``validate`` (I/O), in one sequential pass over each data file.

* Every ``torch.save`` archive the checkpoint stores -- each DCP item of a ``.distcp`` file,
  each whole Megatron-LM legacy rank file / torch.save file -- has the CRC32 of every zip
  record checked (``torch.load`` does not), over a read-only mmap; the records are parsed by
  ``formats._dcp_raw`` (no copies). Archives it cannot follow go through ``zipfile``
  (:func:`check_zip_item`) for the verdict and its message.
* With ``deep``, the same pass counts NaN/Inf of every tensor chunk on its zero-copy view
  (exponent bits tested with numpy: torch is not imported), slab by slab right after the
  slab's CRC (while it is in cache), small tensors in batches; chunks it cannot read in place
  are left to the reader (``validate._deep``).
* ``integrity.json`` sha256 digests.

Files (and runs of items or records of big files) are spread over worker threads: the CRC
(ISA-L's, ~12 GB/s per core; zlib's ~2 GB/s without ``isal``) and numpy release the GIL, so
CRC and counting scale with the cores.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import zipfile
from ckpt_tool._crc import crc32
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_tool.formats._dcp_raw import (BoundedReader, NotSimple, ZipRecord, as_tensor,
                                        check_zip_item, raw_item, zip_records)
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops._checks import (Finding, NonfiniteBatch, count_slabs, crc32_counting, error,
                                   nonfinite, warning)

__all__ = ["BoundedReader", "check_zip_item", "scan_archives", "check_integrity_json"]

_ZIP_LAYOUTS = ("torch_save", "flat")
_WHOLE_FILE_FORMATS = ("legacy", "torch")  # whole files that are torch.save zips
_BLOCK = 1 << 20  # sha256 reads
_SLAB = 4 << 20  # CRC and NaN/Inf counting alternate on slabs this big
_SMALL = 256 << 10  # smaller tensors are counted in batches (NonfiniteBatch)
_UNIT_BYTES = 256 << 20  # a big file's items are split into runs of about this many bytes
_MAX_WORKERS = 16
_local = threading.local()  # a NonfiniteBatch per worker thread


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
    """Work for one thread: archives of one file (or, for a big whole-file archive, a run of
    its ``records``; ``part`` > 0 for all but the first run)."""

    file: str
    archives: list[_Archive] = field(default_factory=list)
    raws: list[_Raw] = field(default_factory=list)
    count_raws: bool = False
    records: list[ZipRecord] | None = None
    part: int = 0


@dataclass
class _Out:
    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, list[int]] = field(default_factory=dict)  # key -> [nan, inf, chunks]
    uncounted: set[str] = field(default_factory=set)
    checked: int = 0
    batch: Any = None

    def add(self, key: str, nan: int, inf: int) -> None:
        c = self.counts.setdefault(key, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + nan, c[1] + inf, c[2] + 1


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _record_runs(path: Path) -> list[list[ZipRecord]] | None:
    """A whole-file archive's records in runs of about ``_UNIT_BYTES`` (None: not simple)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            records = zip_records(m)
    except (OSError, ValueError, NotSimple):
        return None
    if not records or not all(r.stored for r in records):
        return None
    runs: list[list[ZipRecord]] = [[]]
    run_bytes = 0
    for r in sorted(records, key=lambda r: r.start):
        if run_bytes >= _UNIT_BYTES:
            runs.append([])
            run_bytes = 0
        runs[-1].append(r)
        run_bytes += r.size
    return runs


def _plan(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
          skip_objects: set[str], deep: bool) -> list[_Unit]:
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
            runs = _record_runs(base / name) if size > _UNIT_BYTES else None
            if runs is None or len(runs) == 1:
                units.append(u)
                continue
            for i, run in enumerate(runs):  # a big file: its records over several threads
                lo, hi = run[0].start, run[-1].start + run[-1].size
                units.append(_Unit(name, u.archives, [r for r in u.raws if lo <= r.offset < hi],
                                   u.count_raws, run, i))
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


def _bad_crc(rec: ZipRecord, got: int) -> str:
    return f"Bad CRC-32 for file {rec.name!r} (computed {got:08x}, recorded {rec.crc:08x})"


def _records(f: Any, item: memoryview, a: _Archive, u: _Unit, out: _Out
             ) -> list[ZipRecord] | None:
    """The archive's records, or None after ``zipfile`` gave its verdict on an archive the
    raw parser cannot follow (or when a whole file is not a zip: the reader reports that)."""
    try:
        records = zip_records(item)
        if records and all(r.stored for r in records):
            return records
    except NotSimple:
        pass
    if a.count:
        out.uncounted.add(str(a.key))
    if a.what == "file" and not zipfile.is_zipfile(f):
        return None
    why = check_zip_item(f, a.offset, a.length)
    if why is not None:
        out.findings.append(error(f"{a.what} at bytes [{a.offset}, {a.offset + a.length}): "
                                  f"{why}", key=a.key, file=u.file))
    return None


def _tensor(item: memoryview, records: list[ZipRecord], a: _Archive) -> Any:
    """The DCP item's RawItem when it is to be counted in place, else None."""
    if not a.count:
        return None
    try:
        raw = raw_item(item, records)
    except NotSimple:
        return None
    return raw if raw.numel == a.numel else None  # a mismatch: the reader reports it


def _check_archive(f: Any, item: memoryview, a: _Archive, u: _Unit, out: _Out) -> None:
    out.checked += u.part == 0
    records = _records(f, item, a, u, out) if u.records is None else u.records
    if records is None:
        return
    raw = _tensor(item, records, a)
    span = None if raw is None else raw.dense_span()
    counts: tuple[int, int] | None = None
    batched = False
    for r in records:
        with item[r.start:r.start + r.size] as rec:
            if span is not None and r is raw.record:
                lo, hi = span[0] * raw.itemsize, span[1] * raw.itemsize
                if hi - lo <= _SMALL:
                    crc = crc32(rec)
                    with rec[lo:hi] as data:
                        out.batch.add(str(a.key), data, raw.dtype)
                    batched = True
                else:
                    crc, counts = crc32_counting(rec, (lo, hi), raw.dtype, _SLAB)
            else:
                crc = crc32(rec)
        if crc != r.crc:
            bad = f"damaged torch.save archive ({_bad_crc(r, crc)})"
            if a.what != "file":
                out.findings.append(error(f"{a.what} at bytes [{a.offset}, "
                                          f"{a.offset + a.length}): {bad}", key=a.key,
                                          file=u.file))
                break
            keys = sorted({x.key for x in u.raws if r.start <= x.offset < r.start + r.size})
            out.findings.append(error(f"zip record {r.name} at bytes [{r.start}, "
                                      f"{r.start + r.size}): {bad}",
                                      key=keys[0] if keys else None, file=u.file))
    if raw is not None and span is None:  # a strided view that skips or repeats elements
        try:
            t = as_tensor(raw)
            counts = nonfinite(t)
            del t
        except Exception:  # noqa: BLE001 - left to the reader, which reports it
            counts = None
    if a.count and not batched:
        if counts is None:
            out.uncounted.add(str(a.key))
        else:
            out.add(str(a.key), *counts)
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
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            out.findings.append(error(f"cannot map data file ({exc})", file=u.file))
            return out
        try:
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        view = memoryview(mapped)
        out.batch = getattr(_local, "batch", None) or NonfiniteBatch(out.add)
        _local.batch, out.batch.done = None, out.add  # back to the thread once flushed
        try:
            for a in u.archives:
                if 0 <= a.offset and a.offset + a.length <= size:  # else: check_storage
                    with view[a.offset:a.offset + a.length] as item:
                        _check_archive(f, item, a, u, out)
            for r in u.raws if u.count_raws else ():
                if r.offset < 0 or r.offset + r.length > size:
                    continue  # never counted: the reader reports it
                with view[r.offset:r.offset + r.length] as data:
                    if r.length <= _SMALL:
                        out.batch.add(r.key, data, r.dtype)
                    else:
                        out.add(r.key, *count_slabs(data, r.dtype, _SLAB))
            out.batch.flush()
            _local.batch = out.batch
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


def _unit_bytes(u: Any) -> int:
    return sum(r.size for r in u.records) if u.records else sum(a.length for a in u.archives)


def scan_archives(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
                  stats: dict[str, int], skip_objects: set[str], *, deep: bool = False,
                  ranks: Any = None) -> tuple[list[Finding], dict[str, tuple[int, int]]]:
    """CRC32 findings of every torch.save archive of a DCP-based or legacy/torch.save
    checkpoint and, with ``deep``, ``{key: (NaN, Inf)}`` for every tensor whose chunks were
    all counted in place (the others are for the reader). Sets ``stats["zip_items_checked"]``.
    ``ranks``: every rank of a torchrun job calls this; each scans its share of the bytes and
    all get every result (collectives: never pass it when only one rank runs the scan).
    """
    units = _plan(base, meta, sizes, skip_objects, deep)
    from ckpt_tool.parallel import Ranks, split_by_bytes

    job = ranks or Ranks()  # only when every rank of the job runs this scan
    if job.world > 1:  # under torchrun each rank scans its share of the bytes
        share = set(split_by_bytes([(i, max(1, _unit_bytes(u))) for i, u in enumerate(units)],
                                   job.world)[job.rank])
        units = [u for i, u in enumerate(units) if i in share]
    # Python's per-archive work holds the GIL (~30 us); only the bytes (CRC, counting) run in
    # parallel: more threads than the bytes can keep busy only contend for the GIL.
    n = sum(len(u.archives) for u in units)
    nbytes = sum(sum(r.size for r in u.records) if u.records else
                 sum(a.length for a in u.archives) for u in units)
    workers = max(1, min(_workers(), len(units), round(nbytes / 2e9 / max(n * 30e-6, 1e-9))))
    if workers > 1:  # the CRC and numpy release the GIL on the bytes
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-scan") as pool:
            results = list(pool.map(
                lambda u: _scan_unit(base, u, int(sizes[u.file] or 0)), units))
    else:
        results = [_scan_unit(base, u, int(sizes[u.file] or 0)) for u in units]
    if job.world > 1:  # every rank gets every result: the verdict is the same everywhere
        plain = [_Out(r.findings, {k: [int(x) for x in v] for k, v in r.counts.items()},
                      set(r.uncounted), int(r.checked)) for r in results]  # picklable
        parts = job.gather(plain)
        results = job.broadcast([x for part in parts for x in part] if parts else None)
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
