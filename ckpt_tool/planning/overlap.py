"""Which stored bytes a requested rectangle of a global tensor needs.

:func:`reads_for` intersects a rectangle with a tensor's stored chunks and returns one
:class:`SourceRead` per chunk it touches, with the byte range to read:

- ``raw`` chunks (C-order elements): the span from the first to the last needed element (the
  exact bytes when the needed part is contiguous, a covering span otherwise);
- ``torch_save`` items (DCP), chunks with stream transforms, ``flat`` chunks (N-D
  reformulated flattened optimizer state, whose offsets are in ``stored_shape`` coordinates):
  the whole stored item.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass
from typing import Sequence

from ckpt_tool.model import ChunkRef, TensorMeta, dtype_itemsize

__all__ = ["Box", "intersect", "grid_tiling", "SourceRead", "ChunkIndex", "chunk_index",
           "reads_for", "flat_block"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def intersect(a_off: Sequence[int], a_sizes: Sequence[int], b_off: Sequence[int],
              b_sizes: Sequence[int]) -> Box | None:
    """The common rectangle of two rectangles, or None when they do not overlap."""
    off, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_sizes, b_off, b_sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        off.append(lo)
        sizes.append(hi - lo)
    return tuple(off), tuple(sizes)


def grid_tiling(shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """True when ``boxes`` are the cells of a grid that tiles ``shape`` exactly: along each
    axis their intervals partition ``[0, shape[axis])`` and every cell of that grid is one
    box, once (no overlap, no gap). Linear in the boxes: the usual chunk layouts (stacked
    layers x tensor-parallel or expert shards) are proven in one pass; False says only that
    they are not such a grid (a pairwise check must then decide)."""
    if not shape:
        return len(boxes) == 1
    cells = 1
    for axis, size in enumerate(shape):
        pos = 0
        intervals = sorted({(b[0][axis], b[1][axis]) for b in boxes})
        for start, length in intervals:  # a repeated start with two lengths fails here too
            if start != pos or length <= 0:
                return False
            pos += length
        if pos != size:
            return False
        cells *= len(intervals)
    return cells == len(boxes) == len({tuple(b[0]) for b in boxes})


@dataclass(frozen=True)
class SourceRead:
    """Read ``[byte_offset, byte_offset + byte_length)`` of ``file`` (source-root relative):
    it holds ``region`` (global offsets, sizes; for ``flat`` chunks the part of the logical
    block ``flat_range`` of the stored item covers that is needed) of tensor ``key``, stored
    as ``chunk``."""

    key: str
    file: str | None
    byte_offset: int | None
    byte_length: int | None
    region: Box
    chunk: ChunkRef
    flat_range: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "key": self.key, "file": self.file, "byte_offset": self.byte_offset,
            "byte_length": self.byte_length, "region_offsets": list(self.region[0]),
            "region_sizes": list(self.region[1]), "chunk_offsets": list(self.chunk.offsets),
            "chunk_sizes": list(self.chunk.sizes), "layout": self.chunk.layout}
        if self.flat_range is not None:
            d["flat_range"] = list(self.flat_range)
        return d


def _c_span(chunk: ChunkRef, region: Box) -> tuple[int, int]:
    """First and one-past-last C-order element index of ``region`` inside ``chunk``."""
    rel = [o - c for o, c in zip(region[0], chunk.offsets)]
    strides, acc = [], 1
    for s in reversed(chunk.sizes):
        strides.append(acc)
        acc *= s
    strides.reverse()
    first = sum(r * st for r, st in zip(rel, strides))
    last = sum((r + n - 1) * st for r, n, st in zip(rel, region[1], strides))
    return first, last + 1


def flat_block(meta: TensorMeta, chunk: ChunkRef) -> Box:
    """The logical block (offsets, sizes) a ``flat`` chunk's leading stored coordinates name."""
    stored = meta.stored_shape or ()
    block = tuple(s // n for s, n in zip(meta.shape, stored[:-1]))
    return tuple(i * b for i, b in zip(chunk.offsets[:-1], block)), block


class ChunkIndex:
    """A tensor's chunks arranged for quick candidate lookup. When they form a grid
    (:func:`grid_tiling`: stacked layers x tensor-parallel or expert shards) a request finds
    exactly the cells it touches, axis by axis; otherwise the chunks are sorted along axis 0
    and a window of the longest chunk is searched (chunks of one checkpoint do not overlap)."""

    def __init__(self, meta: TensorMeta):
        self.meta = meta
        self.flat = meta.stored_shape is not None and any(c.layout == "flat"
                                                          for c in meta.chunks)
        boxes = [flat_block(meta, c) if self.flat else (c.offsets, c.sizes) for c in meta.chunks]
        order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][:1])
        self.boxes = [boxes[i] for i in order]
        self.chunks = [meta.chunks[i] for i in order]
        self.starts = [b[0][0] if b[0] else 0 for b in self.boxes]
        self.longest = max((b[1][0] for b in self.boxes if b[1]), default=1)
        self._axes: list[list[int]] | None = None  # a grid: each axis's cell starts
        self._cells: dict[tuple[int, ...], int] = {}
        if not self.flat and len(self.boxes) > 1 and meta.shape and all(
                len(b[0]) == len(meta.shape) for b in self.boxes) \
                and grid_tiling(meta.shape, self.boxes):
            self._axes = [sorted({b[0][d] for b in self.boxes}) for d in range(len(meta.shape))]
            self._cells = {tuple(b[0]): i for i, b in enumerate(self.boxes)}

    def candidates(self, offsets: Sequence[int], sizes: Sequence[int]) -> Sequence[int]:
        """Indices (into ``chunks``/``boxes``) of the chunks that may overlap the rectangle."""
        if not offsets:
            return range(len(self.chunks))
        if self._axes is not None and len(offsets) == len(self._axes):
            ranges = []
            for starts, o, n in zip(self._axes, offsets, sizes):
                lo = max(0, bisect.bisect_right(starts, o) - 1)
                hi = bisect.bisect_left(starts, o + n)
                if hi <= lo:
                    return []
                ranges.append(starts[lo:hi])
            return [self._cells[cell] for cell in itertools.product(*ranges)]
        lo = bisect.bisect_left(self.starts, offsets[0] - self.longest + 1)
        hi = bisect.bisect_left(self.starts, offsets[0] + sizes[0])
        return range(lo, hi)


_INDEXES: dict[int, tuple[TensorMeta, ChunkIndex]] = {}
_INDEXES_KEPT = 64
_INDEXES_LOCK = threading.Lock()


def chunk_index(meta: TensorMeta) -> ChunkIndex:
    """The :class:`ChunkIndex` of ``meta``, built once per metadata object (readers hand out
    the same ``TensorMeta`` for every read of a tensor: a lookup per read instead of a scan
    of all its chunks, which made reading every chunk of a tensor quadratic in its chunks)."""
    with _INDEXES_LOCK:
        hit = _INDEXES.get(id(meta))  # the entry holds meta: its id is not reused meanwhile
    if hit is not None and hit[0] is meta:
        return hit[1]
    index = ChunkIndex(meta)
    with _INDEXES_LOCK:
        if len(_INDEXES) >= _INDEXES_KEPT:
            _INDEXES.pop(next(iter(_INDEXES)))
        _INDEXES[id(meta)] = (meta, index)
    return index


def reads_for(index: ChunkIndex, offsets: Sequence[int], sizes: Sequence[int]
              ) -> list[SourceRead]:
    """The stored reads covering the rectangle ``offsets``/``sizes`` of ``index.meta``."""
    meta = index.meta
    item = dtype_itemsize(meta.dtype)
    out: list[SourceRead] = []
    for i in index.candidates(offsets, sizes):
        box, chunk = index.boxes[i], index.chunks[i]
        region = intersect(offsets, sizes, box[0], box[1])
        if region is None:
            continue
        if index.flat:
            first, stop = _c_span(ChunkRef(box[0], box[1]), region)
            f0 = chunk.offsets[-1]
            f1 = f0 + chunk.sizes[-1]
            if stop <= f0 or first >= f1:
                continue
            out.append(SourceRead(meta.key, chunk.file, chunk.byte_offset, chunk.byte_length,
                                  region, chunk, (f0, f1)))
            continue
        if chunk.layout == "raw" and not chunk.transforms and chunk.byte_offset is not None:
            first, stop = _c_span(chunk, region)
            out.append(SourceRead(meta.key, chunk.file, chunk.byte_offset + first * item,
                                  (stop - first) * item, region, chunk))
        else:
            out.append(SourceRead(meta.key, chunk.file, chunk.byte_offset, chunk.byte_length,
                                  region, chunk))
    return out

