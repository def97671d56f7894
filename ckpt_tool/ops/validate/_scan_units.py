"""The work units of ``validate``'s integrity pass (``_integrity_pass``), and how they are planned.

A :class:`Unit` is one thread's work in one file: a run of DCP items (held column-wise in
:class:`Items`, thousands of them without an object per item) or whole-file archives
(Megatron-LM legacy rank files, torch.save files) with the raw chunks inside them; a big file
is cut into runs of about ``unit_bytes``. :class:`Out` is what a unit found. Planning
(:func:`plan_items`, :func:`plan_files`) reads only the metadata, and a whole-file archive's
zip directory when it must be cut; the per-item path (``_scan_item``) and the bulk path
(``_scan_vector``) do the checking.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple, ZipRecord, zip_records
from ckpt_tool.model import Finding

__all__ = ["Archive", "Raw", "Items", "Unit", "Out", "plan_files", "plan_items"]

_ZIP_LAYOUTS = ("torch_save", "flat")


class Archive(NamedTuple):
    """A torch.save archive at ``[offset, offset+length)``: the DCP item of ``chunk`` (a
    ``ChunkRef``; ``kind`` "chunk") or of an object, or a whole file (``kind`` "file");
    a chunk's tensor must hold ``numel`` elements of ``dtype`` (what the metadata says of
    ``key``; ``kid`` the key's index in ``meta.tensors``); ``count``: deep-count it."""

    offset: int
    length: int
    key: str | None
    kind: str  # "chunk", "object" or "file"
    chunk: Any = None
    count: bool = False
    numel: int = -1
    kid: int = -1
    dtype: str | None = None

    @property
    def what(self) -> str:
        """How findings name it: "chunk [..]", "object" or "file"."""
        if self.kind == "chunk":
            return f"chunk {_box(self.chunk.offsets, self.chunk.sizes)}"
        return self.kind


@dataclass(frozen=True)
class Raw:
    """A chunk stored as plain little-endian elements inside a whole-file archive (legacy)."""

    offset: int
    length: int
    dtype: str
    key: str


@dataclass
class Items:
    """DCP items column-wise (numpy arrays), file by file and by offset: ``kid`` the tensor's
    index in ``keys`` (its chunk ``refs[i]``), or -1 for an object (its unique key
    ``refs[i]``); ``numel``: elements of the chunk; ``dtypes[kid_dtype[kid]]`` the tensor's
    dtype; tensors are counted when ``deep``."""

    offset: Any
    length: Any
    kid: Any
    numel: Any
    refs: list[Any]
    keys: list[str]
    deep: bool
    kid_dtype: Any = None
    dtypes: tuple[str, ...] = ()

    def archive(self, i: int) -> Archive:
        """Item ``i`` for the per-item path."""
        k, ref = int(self.kid[i]), self.refs[i]
        if k < 0:
            return Archive(int(self.offset[i]), int(self.length[i]), ref, "object")
        return Archive(int(self.offset[i]), int(self.length[i]), self.keys[k], "chunk", ref,
                       self.deep, int(self.numel[i]), k, self.dtypes[int(self.kid_dtype[k])])

    def expected_dtype(self, kid: Any) -> Any:
        """Per item of tensors ``kid`` (-1: an object), the index in ``dtypes`` of what it
        must hold (-1 for objects)."""
        return np.where(kid >= 0, self.kid_dtype[np.maximum(kid, 0)], -1)


@dataclass
class Unit:
    """Work for one thread: DCP items ``[lo, hi)`` of ``items``, all of one file (a run of
    them in a big file), or ``archives`` of one file (for a big whole-file archive, a run of
    its ``records``; ``part`` > 0 for all but the first run); ``nbytes``: their bytes."""

    file: str
    archives: list[Archive] = field(default_factory=list)
    raws: list[Raw] = field(default_factory=list)
    count_raws: bool = False
    records: list[ZipRecord] | None = None
    part: int = 0
    items: Items | None = None
    lo: int = 0
    hi: int = 0
    nbytes: int = 0


@dataclass
class Out:
    """What a unit (or a batch of units) found: ``counts`` and ``uncounted`` by key from the
    per-item path, ``bulk`` from the bulk path; ``checked``, the archives checked."""

    findings: list[Finding] = field(default_factory=list)
    counts: dict[str, list[int]] = field(default_factory=dict)  # key -> [nan, inf, chunks]
    uncounted: set[str] = field(default_factory=set)
    checked: int = 0
    batch: Any = None
    bulk: tuple[Any, Any, Any] | None = None  # arrays: kid, nan, inf of chunks counted in bulk

    def add(self, key: str, nan: int, inf: int) -> None:
        c = self.counts.setdefault(key, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + nan, c[1] + inf, c[2] + 1

    def add_bulk(self, kid: Any, nan: Any, inf: Any) -> None:
        """Counts of chunks of tensors ``kid`` (arrays)."""
        if self.bulk is not None:
            kid, nan, inf = (np.concatenate([a, b]) for a, b in zip(self.bulk, (kid, nan, inf)))
        self.bulk = (kid, nan, inf)


def _box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"


def _record_runs(path: Path, unit_bytes: int) -> list[list[ZipRecord]] | None:
    """A whole-file archive's records in runs of about ``unit_bytes`` (None: not simple)."""
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
        if run_bytes >= unit_bytes:
            runs.append([])
            run_bytes = 0
        runs[-1].append(r)
        run_bytes += r.size
    return runs


def plan_files(base: Path, meta: Any, sizes: dict[str, int | None], deep: bool,
               unit_bytes: int) -> list[Unit]:
    """Whole-file archives (Megatron-LM legacy rank files, torch.save files) in name order,
    each with its raw chunks; a big one's records in runs of about ``unit_bytes``."""
    files: dict[str, Unit] = {}
    for key, t in meta.tensors.items():
        for c in t.chunks:
            if c.file and not c.transforms and c.layout == "raw" and c.byte_offset is not None \
                    and c.byte_length is not None:
                files.setdefault(c.file, Unit(c.file, count_raws=deep)).raws.append(
                    Raw(c.byte_offset, c.byte_length, t.dtype, key))
    for o in meta.objects:
        if o.file:
            files.setdefault(o.file, Unit(o.file, count_raws=deep))
    units = []
    for name in sorted(files):
        u, size = files[name], sizes.get(name)
        if size is None:
            continue  # reported by check_storage
        u.archives.append(Archive(0, size, None, "file"))
        u.nbytes = size
        runs = _record_runs(base / name, unit_bytes) if size > unit_bytes else None
        if runs is None or len(runs) == 1:
            units.append(u)
            continue
        for i, run in enumerate(runs):  # a big file: its records over several threads
            lo, hi = run[0].start, run[-1].start + run[-1].size
            units.append(Unit(name, u.archives, [r for r in u.raws if lo <= r.offset < hi],
                              u.count_raws, run, i, nbytes=sum(r.size for r in run)))
    return units


def plan_items(meta: Any, sizes: dict[str, int | None], skip_objects: set[str], deep: bool,
               unit_bytes: int) -> list[Unit]:
    """DCP items, gathered column-wise (thousands of them: no object per item), in units of a
    file's items (runs of about ``unit_bytes`` of a big file), by file name."""
    files: dict[str, int] = {}
    cols: tuple[list[Any], ...] = ([], [], [], [], [], [])  # file, offset, length, kid, numel
    file, offset, length, kid, numel, refs = (x.append for x in cols)  # ... and the chunk
    prod = math.prod
    for k, t in enumerate(meta.tensors.values()):
        for c in t.chunks:
            o, n, name = c.byte_offset, c.byte_length, c.file
            if o is None or n is None or not name or c.transforms or c.layout not in _ZIP_LAYOUTS:
                continue
            f = files.get(name)
            if f is None:
                f = files[name] = len(files)
            file(f)
            offset(o)
            length(n)
            kid(k)
            numel(prod(c.sizes))
            refs(c)
    for o in meta.objects:  # (the objects' items)
        if o.file and o.unique_key not in skip_objects and o.byte_offset is not None \
                and o.byte_length is not None:
            for col, x in zip(cols, (files.setdefault(o.file, len(files)), o.byte_offset,
                                     o.byte_length, -1, -1, o.unique_key)):
                col.append(x)
    names = sorted(files)
    rank = np.empty(len(names), np.int64)
    rank[[files[n] for n in names]] = np.arange(len(names))
    f_rank = rank[np.array(cols[0], dtype=np.int64)]
    order = np.lexsort((np.array(cols[1], dtype=np.int64), f_rank))
    f_rank, off, ln, kids, numels = (np.asarray(x, dtype=np.int64)[order]
                                     for x in (f_rank, *cols[1:5]))
    chunks = [cols[5][i] for i in order.tolist()]
    cut = np.searchsorted(f_rank, np.arange(len(names) + 1)).tolist()
    cum = np.concatenate([[0], np.cumsum(ln)])
    cum_l = cum.tolist()
    dtypes = tuple(sorted({t.dtype for t in meta.tensors.values()}))
    kid_dtype = np.array([dtypes.index(t.dtype) for t in meta.tensors.values()] or [0],
                         dtype=np.int64)
    items = Items(off, ln, kids, numels, chunks, list(meta.tensors), deep, kid_dtype, dtypes)
    units = []
    for r, name in enumerate(names):
        if sizes.get(name) is None:
            continue  # reported by check_storage
        start, stop = cut[r], cut[r + 1]
        while start < stop:  # runs of about unit_bytes
            end = stop if cum_l[stop] - cum_l[start] < unit_bytes else min(stop, int(
                np.searchsorted(cum, cum_l[start] + unit_bytes)))
            units.append(Unit(name, items=items, lo=start, hi=end,
                              nbytes=cum_l[end] - cum_l[start]))
            start = end
    return units
