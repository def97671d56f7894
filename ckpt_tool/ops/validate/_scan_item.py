"""The per-item path of ``validate``'s integrity pass (``_integrity_pass``) over the work units
of ``_scan_units``.

Each ``torch.save`` archive is parsed on its own by ``formats.containers.torch_zip.torch_zip_read`` over a read-only mmap
(no copies): the CRC32 of every zip record checked and, with ``deep``, the NaN/Inf of its
tensor counted on the zero-copy view, slab by slab right after the slab's CRC, small tensors in
batches (``NonfiniteBatch``). Archives the raw parser cannot follow go through ``zipfile``
(:func:`check_zip_item`) for the verdict and its message. Whole-file archives (Megatron-LM
legacy rank files, torch.save files) always take this path; DCP items take it when the bulk
path (``_scan_vector``) leaves them, which gives the same findings, only more slowly.
"""

from __future__ import annotations

import mmap
import threading
import zipfile
from pathlib import Path
from typing import Any

from ckpt_tool._crc import crc32
from ckpt_tool.formats.containers.torch_zip.archive_check import check_zip_item
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import as_tensor, raw_item
from ckpt_tool.formats.containers.torch_zip.zip_directory import (NotSimple, TorchRejects,
                                                                  ZipRecord, zip_records)
from ckpt_tool.ops.validate._checks import (NonfiniteBatch, count_slabs, crc32_counting, error,
                                            nonfinite)
from ckpt_tool.ops.validate._scan_units import Archive, Out, Unit
from ckpt_tool.storage import is_remote, open_read

__all__ = ["scan_unit", "check_slowly"]

_local = threading.local()  # a NonfiniteBatch per worker thread


def _bad_crc(rec: ZipRecord, got: int) -> str:
    return f"Bad CRC-32 for file {rec.name!r} (computed {got:08x}, recorded {rec.crc:08x})"


def _records(f: Any, item: memoryview, a: Archive, u: Unit, out: Out
             ) -> list[ZipRecord] | None:
    """The archive's records, or None after ``zipfile`` gave its verdict on an archive the
    raw parser cannot follow (or when a whole file is not a zip: the reader reports that)."""
    try:
        records = zip_records(item)
        if records and all(r.stored for r in records):
            return records
    except TorchRejects as exc:
        if a.count:
            out.uncounted.add(str(a.key))
        out.findings.append(error(f"{a.what} at bytes [{a.offset}, {a.offset + a.length}): "
                                  f"damaged torch.save archive: {exc} (torch.load refuses it)",
                                  key=a.key, file=u.file))
        return None
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


def _tensor(item: memoryview, records: list[ZipRecord], a: Archive, u: Unit, out: Out) -> Any:
    """The DCP item's RawItem when it is to be counted in place, else None; an error finding
    when its tensor is not what the metadata says (the item is the ground truth: its pickled
    dtype and element count)."""
    if a.kind != "chunk":
        return None
    try:
        raw = raw_item(item, records)
    except TorchRejects as exc:  # (its pickle names a storage it lacks)
        out.findings.append(error(f"{a.what} at bytes [{a.offset}, {a.offset + a.length}): "
                                  f"damaged torch.save archive: {exc} (torch.load refuses "
                                  "it)", key=a.key, file=u.file))
        if a.count:
            out.uncounted.add(str(a.key))
        return None
    except NotSimple:  # read through torch.load by the reader, which compares the same
        return None
    if (a.dtype is not None and raw.dtype != a.dtype) or (a.numel >= 0 and raw.numel != a.numel):
        out.findings.append(error(
            f"{a.what} at bytes [{a.offset}, {a.offset + a.length}): the stored item holds "
            f"{raw.numel} {raw.dtype} elements {list(raw.shape)}, the metadata says "
            f"{a.numel} {a.dtype}", key=a.key, file=u.file))
        if a.count:
            out.uncounted.add(str(a.key))
        raw.data.release()
        return None
    if not a.count:
        raw.data.release()
        return None
    return raw


def _check_archive(f: Any, item: memoryview, a: Archive, u: Unit, out: Out, small: int,
                   slab: int) -> None:
    out.checked += u.part == 0
    records = _records(f, item, a, u, out) if u.records is None else u.records
    if records is None:
        return
    raw = _tensor(item, records, a, u, out)
    span = None if raw is None else raw.dense_span()
    counts: tuple[int, int] | None = None
    batched = False
    for r in records:
        with item[r.start:r.start + r.size] as rec:
            if span is not None and r is raw.record:
                lo, hi = span[0] * raw.itemsize, span[1] * raw.itemsize
                if hi - lo <= small:
                    crc = crc32(rec)
                    with rec[lo:hi] as data:
                        out.batch.add(str(a.key), data, raw.dtype)
                    batched = True
                else:
                    crc, counts = crc32_counting(rec, (lo, hi), raw.dtype, slab)
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


def scan_unit(base: Path, u: Unit, size: int, small: int, slab: int) -> Out:
    """Check every archive (and count the raw chunks) of ``u`` in its ``size``-byte file;
    tensors of at most ``small`` bytes are counted in batches, bigger ones in slabs."""
    out = Out()
    if u.items is not None:
        u = Unit(u.file, [u.items.archive(i) for i in range(u.lo, u.hi)])
    if is_remote(base):  # its ranges could not be fetched (``_mapped_ranges``): the object is gone
        out.findings.append(error("cannot read data file (the object is missing or shorter "
                                  "than when it was listed)", file=u.file))
        return out
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
                        _check_archive(f, item, a, u, out, small, slab)
            for r in u.raws if u.count_raws else ():
                if r.offset < 0 or r.offset + r.length > size:
                    continue  # never counted: the reader reports it
                with view[r.offset:r.offset + r.length] as data:
                    if r.length <= small:
                        out.batch.add(r.key, data, r.dtype)
                    else:
                        out.add(r.key, *count_slabs(data, r.dtype, slab))
            out.batch.flush()
            _local.batch = out.batch
        finally:
            view.release()
            try:
                mapped.close()
            except BufferError:
                pass
    return out


def check_slowly(base: Path, view: memoryview, shift: int, archives: list[Archive], u: Unit,
                 out: Out, small: int, slab: int) -> None:
    """:func:`_check_archive` of each of ``archives`` of ``u``, at ``offset + shift`` of
    ``view`` (a mapping of its file)."""
    try:
        f = open_read(base / u.file)
    except OSError as exc:  # gone since it was mapped
        out.findings.append(error(f"cannot open data file ({exc.strerror})", file=u.file))
        return
    out.batch = getattr(_local, "batch", None) or NonfiniteBatch(out.add)
    _local.batch, out.batch.done = None, out.add
    with f:
        for a in archives:
            with view[a.offset + shift:a.offset + shift + a.length] as item:
                _check_archive(f, item, a, u, out, small, slab)
    out.batch.flush()
    _local.batch = out.batch
