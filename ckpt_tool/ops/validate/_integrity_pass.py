"""Integrity checks of ``validate`` (I/O), in one sequential pass over each data file.

* Every ``torch.save`` archive the checkpoint stores -- each DCP item of a ``.distcp`` file,
  each whole Megatron-LM legacy rank file / torch.save file -- has the CRC32 of every zip
  record checked (``torch.load`` does not), over a read-only mmap (no copies).
* With ``deep``, the same pass counts NaN/Inf of every tensor chunk in place (exponent bits
  tested with numpy: torch is not imported), right after its CRC (while it is in cache);
  chunks it cannot read in place are left to the reader (``validate._deep``).
* integrity manifests (``integrity.json``, ``ckpt-manifest.json``): ``ops/_manifest.py``.

DCP items -- thousands of small ``torch.save`` zips -- are checked in bulk, a batch of files at
a time (``_scan_vector``: a fixed number of numpy operations per batch, one CRC call per
record, small tensors counted a megabyte at a time); whole-file archives, and any item the bulk
path does not prove plain, go through the per-item path (``_scan_item``), which gives every
verdict and message. Batches (and runs of records of big files) are spread over worker
threads when their pieces are big: the CRC (ISA-L's, ~12 GB/s per core; zlib's ~2 GB/s without
``isal``), the mapping of files and numpy release the GIL. Small pieces are checked on one
thread (GIL hand-offs would cost more), with a helper thread filling the page tables of the
next batch's mapping and unmapping the last one (:func:`_in_turn`).
"""

from __future__ import annotations

import gc
import mmap
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np

from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops.validate._checks import error
from ckpt_tool.model import Finding
from ckpt_tool.ops._mapped_ranges import map_ranges, prefault
from ckpt_tool.ops.validate._scan_item import check_slowly, scan_unit
from ckpt_tool.ops.validate._scan_units import Out, Unit, plan_files, plan_items
from ckpt_tool.ops.validate._scan_vector import scan_items
from ckpt_tool.storage import read_range

__all__ = ["scan_archives", "check_loose_archives"]

_SLAB = 4 << 20  # CRC and NaN/Inf counting alternate on slabs this big
_SMALL = 256 << 10  # smaller tensors are counted in batches
_UNIT_BYTES = 64 << 20  # a big file's items are split into runs of about this many bytes
# (what is mapped at once: a few of these, or the largest item; 256 MiB mapped 2-3 at a time
# made the file-backed RSS of a verify pass ~450 MB, with no gain in speed)
_MAX_WORKERS = 16
_ALIGN = mmap.ALLOCATIONGRANULARITY  # where a mapping of part of a file may start
_BATCH_UNITS = 128  # DCP files checked in bulk together (each mapped meanwhile) ...
_BATCH_BYTES = 64 << 20  # ... up to about this many bytes (batches are the threads' work)
_THREAD_BYTES = 1 << 20  # a worker thread per this many bytes per archive or raw chunk


def _plan(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
          skip_objects: set[str], deep: bool) -> list[Unit]:
    """The work, file by file in name order: a DCP file's items (runs of about
    ``_UNIT_BYTES`` of a big file), or a whole-file archive (a big one's records in runs)."""
    if meta.kind.whole_file_archives:
        return plan_files(base, meta, sizes, deep, _UNIT_BYTES)
    return plan_items(meta, sizes, skip_objects, deep, _UNIT_BYTES)


class _Batch(NamedTuple):
    """DCP-item units mapped for the bulk path: their items' columns (``unit``: each item's
    unit; ``firsts``: each unit's first item; ``inside``: within its file), and ``regions``
    (``map_ranges``) where byte ``lo[i]`` of unit ``todo[j]`` lies at ``at[j]``."""

    units: list[Unit]
    off: np.ndarray
    ln: np.ndarray
    kid: np.ndarray
    numel: np.ndarray
    unit: np.ndarray
    firsts: np.ndarray
    inside: np.ndarray
    size: np.ndarray
    lo: np.ndarray
    todo: list[int]
    regions: list[Any]


def _map_batch(base: Path, units: list[Unit], sizes: dict[str, int | None],
               populate: bool = True) -> _Batch:
    """The items of ``units`` and a mapping of the bytes they span in each file."""
    items = units[0].items
    per_unit = [u.hi - u.lo for u in units]  # each unit has items
    unit = np.repeat(np.arange(len(units)), per_unit)
    if all(a.hi == b.lo for a, b in zip(units, units[1:])):  # consecutive: a slice
        index: Any = slice(units[0].lo, units[-1].hi)
    else:
        index = np.concatenate([np.arange(u.lo, u.hi) for u in units])
    off, ln, kid, numel = (x[index] for x in (items.offset, items.length, items.kid,
                                              items.numel))
    size = np.array([int(sizes[u.file] or 0) for u in units], dtype=np.int64)
    inside = (off >= 0) & (off + ln <= size[unit])  # else: reported by check_storage
    firsts = np.cumsum(per_unit) - per_unit
    lo = np.minimum.reduceat(np.where(inside, off, np.iinfo(np.int64).max), firsts)
    hi = np.maximum.reduceat(np.where(inside, off + ln, -1), firsts)
    todo = np.flatnonzero(hi >= 0).tolist()
    lo = np.where(hi >= 0, lo, 0) // _ALIGN * _ALIGN
    regions = map_ranges([(base / units[i].file, int(lo[i]), int(hi[i])) for i in todo],
                         populate)
    return _Batch(units, off, ln, kid, numel, unit, firsts, inside, size, lo, todo, regions)


def _close(regions: list[Any]) -> None:
    for region, _ in regions:
        try:
            region.close()
        except BufferError:  # a view still held (by the per-item path): unmapped later
            pass


def _scan_batch(base: Path, b: _Batch, close: Any = _close) -> list[Out]:
    """The results of a batch of DCP-item units (the bulk counts first, then the per-item
    findings in unit order): most items checked in bulk (``_scan_vector.scan_items``) over
    the batch's mapping, the others -- and files that cannot be mapped -- by the per-item path
    (``_scan_item``). ``close(b.regions)`` at the end."""
    units, unit, kid = b.units, b.unit, b.kid
    bulk, outs = Out(), [None] * len(units)
    try:
        for region, at in b.regions:
            mine = [(i, place - int(b.lo[i])) for i, place in zip(b.todo, at)
                    if place is not None]
            shift = np.zeros(len(units), np.int64)
            shift[[i for i, _ in mine]] = [d for _, d in mine]
            sel = np.flatnonzero(b.inside & np.isin(unit, [i for i, _ in mine]))
            items = units[0].items
            count = (kid[sel] >= 0) & items.deep
            done, nan, inf = scan_items(region, b.off[sel] + shift[unit[sel]], b.ln[sel], count,
                                        b.numel[sel], small=_SMALL, slab=_SLAB,
                                        dtype=items.expected_dtype(kid[sel]),
                                        dtypes=items.dtypes)
            bulk.checked += int(done.sum())
            bulk.add_bulk(kid[sel][count & done], nan[count & done], inf[count & done])
            for i, _ in mine:
                outs[i] = Out()
            if not done.all():
                _slowly(base, units, region, sel[~done], unit, b.firsts, shift, outs)
    finally:
        close(b.regions)
    return [bulk] + [out if out is not None else scan_unit(base, u, int(s), _SMALL, _SLAB)
                     for u, out, s in zip(units, outs, b.size.tolist())
                     if out is None or out.findings or out.counts or out.uncounted or out.checked]


def _slowly(base: Path, units: list[Unit], region: Any, left: np.ndarray, unit: np.ndarray,
            firsts: np.ndarray, shift: np.ndarray, outs: list[Any]) -> None:
    """The per-item path for the items ``left`` (indices into the batch's items; ``unit[i]``
    their unit, whose first item is ``firsts[unit]``) that the bulk path left, by unit."""
    with memoryview(region) as view:
        for i in sorted(set(unit[left].tolist())):
            u = units[i]
            archives = [u.items.archive(u.lo + j - int(firsts[i]))
                        for j in left[unit[left] == i].tolist()]
            check_slowly(base, view, int(shift[i]), archives, u, outs[i], _SMALL, _SLAB)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cycle collector paused: the scan makes tens of thousands of short-lived
    containers (freed by reference counting, no cycles), and each collection would walk them
    again (~5% of the time of a scan of small items)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _workers() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, n))


def _whole(u: Unit) -> bool:
    """Whether the unit is (a run of records of) a whole-file archive, not DCP items."""
    return u.items is None


class _Tracker:
    """Tells a progress sink (``start(total_bytes, total_count, unit)``, ``update(nbytes,
    count_done)``) the bytes scanned and the files finished, from any worker thread."""

    def __init__(self, sink: Any, units: list[Unit]) -> None:
        self._sink = sink
        self._left = Counter(u.file for u in units)  # units still to scan, per file
        self._files = 0
        self._lock = threading.Lock()
        if sink is not None:
            sink.start(sum(u.nbytes for u in units), len(self._left), unit="file")

    def done(self, units: list[Unit]) -> None:
        if self._sink is None:
            return
        with self._lock:
            for u in units:
                self._left[u.file] -= 1
                self._files += self._left[u.file] == 0
            self._sink.update(sum(u.nbytes for u in units), self._files)


def _run(base: Path, units: list[Unit], sizes: dict[str, int | None],
         helper: ThreadPoolExecutor, tracker: _Tracker) -> list[Out]:
    """The results (findings in unit order): DCP-item units in batches (:func:`_scan_batch`),
    whole-file archives one unit at a time, over worker threads (or on this one, with
    ``helper`` mapping ahead: :func:`_in_turn`)."""
    jobs: list[list[int]] = []
    batch: list[int] = []
    batch_bytes = 0
    for i, u in enumerate(units):
        if _whole(u):
            jobs.append([i])
            continue
        batch.append(i)
        batch_bytes += u.nbytes
        # (a small first batch: the helper has nothing to map ahead of it)
        if len(batch) == (_BATCH_UNITS if jobs else max(1, _BATCH_UNITS // 8)) \
                or batch_bytes >= _BATCH_BYTES:
            jobs.append(batch)
            batch, batch_bytes = [], 0
    if batch:
        jobs.append(batch)

    def one(job: list[int]) -> list[Out]:
        u = units[job[0]]
        if _whole(u):
            out = [scan_unit(base, u, int(sizes[u.file] or 0), _SMALL, _SLAB)]
        else:
            out = _scan_batch(base, _map_batch(base, [units[i] for i in job], sizes))
        tracker.done([units[i] for i in job])
        return out

    # Every CRC call and numpy operation releases the GIL and takes it back: threads pay off
    # only when each of those works on enough bytes; on small items, hand-offs of the GIL
    # between threads cost more than they save.
    pieces = sum(u.hi - u.lo if u.items else len(u.archives) + len(u.raws) for u in units)
    nbytes = sum(u.nbytes for u in units)
    workers = max(1, min(_workers(), len(jobs), round(nbytes / max(pieces, 1) / _THREAD_BYTES)))
    if workers > 1:  # the CRC and numpy release the GIL on the bytes
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-scan") as pool:
            parts = list(pool.map(one, jobs))
    else:
        parts = _in_turn(base, units, jobs, sizes, helper, tracker)
    return [r for part in parts for r in part]


def _in_turn(base: Path, units: list[Unit], jobs: list[list[int]],
             sizes: dict[str, int | None], helper: ThreadPoolExecutor,
             tracker: _Tracker) -> list[list[Out]]:
    """The jobs one after another on this thread, while ``helper`` fills the page tables of
    the next batch's mapping and unmaps the last one (kernel work, without the GIL). The
    mappings are made here, while the helper is idle: the kernel serialises mmap, munmap and
    page table population in a process."""
    parts: list[list[Out]] = []
    ahead: tuple[_Batch, list[Any]] | None = None  # the next batch; its page tables filling
    done: list[Any] = []  # the regions of checked batches, to unmap

    def map_ahead(k: int) -> None:
        nonlocal ahead
        for f in ahead[1] if ahead else ():
            f.result()
        ahead = None
        if k < len(jobs) and not _whole(units[jobs[k][0]]):
            b = _map_batch(base, [units[i] for i in jobs[k]], sizes, populate=False)
            ahead = b, [helper.submit(prefault, r) for r, _ in b.regions]
        while done:
            helper.submit(_close, done.pop())

    try:
        map_ahead(0)
        for k, job in enumerate(jobs):
            now = ahead
            map_ahead(k + 1)
            if now is None:
                u = units[job[0]]
                parts.append([scan_unit(base, u, int(sizes[u.file] or 0), _SMALL, _SLAB)])
            else:
                parts.append(_scan_batch(base, now[0], done.append))
            tracker.done([units[i] for i in job])
    finally:
        for regions in done + ([ahead[0].regions] if ahead else []):
            helper.submit(_close, regions)  # after the prefaults, by the same thread
    return parts


def scan_archives(base: Path, meta: CheckpointMeta, sizes: dict[str, int | None],
                  stats: dict[str, int], skip_objects: set[str], *, deep: bool = False,
                  ranks: Any = None, progress: Any = None,
                  proven: frozenset[str] = frozenset(),
                  ) -> tuple[list[Finding], dict[str, tuple[int, int]]]:
    """CRC32 findings of every torch.save archive of a DCP-based or legacy/torch.save
    checkpoint and, with ``deep``, ``{key: (NaN, Inf)}`` for every tensor whose chunks were
    all counted in place (the others are for the reader). Sets ``stats["zip_items_checked"]``.
    ``ranks``: every rank of a torchrun job calls this; each scans its share of the bytes and
    all get every result (collectives: never pass it when only one rank runs the scan).
    ``progress``: told the bytes scanned and the files finished (this rank's share).
    ``proven``: data files (relative names) whose bytes were proven as they were written
    (``ckpt_tool.digests.proven_files``): not read again (``stats["files_proven_written"]``).
    """
    from ckpt_tool.parallel import Ranks, split_by_bytes

    # (the helper unmaps the last batch while the results are gathered)
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-map") as helper, _gc_paused():
        units = _plan(base, meta, sizes, skip_objects, deep)
        if proven and not deep:
            stats["files_proven_written"] = len({u.file for u in units if u.file in proven})
            units = [u for u in units if u.file not in proven]
        job = ranks or Ranks()  # only when every rank of the job runs this scan
        if job.world > 1:  # under torchrun each rank scans its share of the bytes
            share = set(split_by_bytes([(i, max(1, u.nbytes)) for i, u in enumerate(units)],
                                       job.world)[job.rank])
            units = [u for i, u in enumerate(units) if i in share]
        results = _run(base, units, sizes, helper, _Tracker(progress, units))
        if job.world > 1:  # every rank gets every result: the verdict is the same everywhere
            plain = [Out(r.findings, {k: [int(x) for x in v] for k, v in r.counts.items()},
                         set(r.uncounted), int(r.checked), None, r.bulk)
                     for r in results]  # picklable
            parts = job.gather(plain)
            results = job.broadcast([x for part in parts for x in part] if parts else None)
        stats["zip_items_checked"] = sum(r.checked for r in results)
        return [f for r in results for f in r.findings], _counted(meta, results)


def check_loose_archives(base: Path, meta: CheckpointMeta) -> list[Finding]:
    """CRC32 findings of the ``torch.save`` files of a Megatron-Core dist checkpoint that
    :func:`scan_archives` does not see: ``common.pt`` and zarr's object files (small: each
    checked whole, ``formats.containers.torch_zip.archive_check``)."""
    from ckpt_tool.errors import CorruptCheckpointError
    from ckpt_tool.formats.containers.torch_zip.archive_check import check_file

    if not meta.kind.megatron_dist:
        return []
    names = ["common.pt"] if (base / "common.pt").is_file() else []
    if meta.kind.zarr_arrays:
        names += sorted({o.file for o in meta.objects if o.file})
    out = []
    for name in names:
        try:
            if read_range(base / name, 0, 4) != b"PK\x03\x04":
                continue  # not a zip (empty, a legacy pickle): the loaders say why
            check_file(base / name, "file")
        except CorruptCheckpointError as exc:
            out.append(error(exc.message, file=name))
        except OSError:
            continue  # missing or unreadable: reported by the storage checks
    return out


def _counted(meta: CheckpointMeta, results: list[Out]) -> dict[str, tuple[int, int]]:
    """``{key: (NaN, Inf)}`` of the tensors whose every chunk was counted."""
    keys = list(meta.tensors)
    kid, nan, inf = (np.concatenate([np.asarray(r.bulk[j], dtype=np.int64) for r in results
                                     if r.bulk is not None] + [np.zeros(0, np.int64)])
                     for j in range(3))
    total = np.stack([np.bincount(kid, weights=nan, minlength=len(keys)),
                      np.bincount(kid, weights=inf, minlength=len(keys)),
                      np.bincount(kid, minlength=len(keys))]).astype(np.int64)
    uncounted: set[str] = set()
    if any(r.counts or r.uncounted for r in results):
        index = {k: i for i, k in enumerate(keys)}
        for r in results:
            uncounted |= r.uncounted
            for k, v in r.counts.items():
                total[:, index[k]] += v
    chunks = np.array([len(t.chunks) for t in meta.tensors.values()], dtype=np.int64)
    done = np.flatnonzero((total[2] == chunks) & (total[2] > 0))
    return {keys[i]: (n, f) for i, n, f in zip(done.tolist(), total[0, done].tolist(),
                                                total[1, done].tolist())
            if keys[i] not in uncounted}
