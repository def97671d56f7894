"""A torch-free ``TensorSource`` for byte-moving conversions (DCP-based source -> safetensors).

When no dtype changes and every chunk of a tensor is a plain ``torch.save`` item, the bytes can
be moved without torch: each item is located in place over mmap (``formats.torch_zip``) and its
elements copied with numpy into the requested rectangle. Pieces are numpy arrays of unsigned
integers of the element's size (the bytes are what matter); anything unusual falls back to the
torch path, per tensor. Skipping ``import torch`` (about 1 s) is most of a small conversion.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, IntegrityError
from ckpt_tool.formats.archive_check import check_fetched, check_item
from ckpt_tool.formats.torch_zip import raw_item
from ckpt_tool.formats.zip_directory import NotSimple
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import ChunkRef, TensorMeta, dtype_itemsize
from ckpt_tool.ops._mapping import Fetched
from ckpt_tool.storage import as_path, is_remote, read_into

__all__ = ["RawSource", "raw_source_applies"]

_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def raw_source_applies(reader: Reader, key_map: dict[str, str], dtypes: dict[str, str]) -> bool:
    """True when every selected tensor can be moved as raw bytes (no cast, DCP items)."""
    meta = reader.metadata()
    if dtypes or meta.format not in ("torch_dist", "dcp"):
        return False
    return all(_movable(meta.tensors[k]) for k in key_map.values())


def _movable(t: TensorMeta) -> bool:
    return (t.stored_shape is None and bool(t.chunks) and dtype_itemsize(t.dtype) in _UINT
            and all(c.layout == "torch_save" and not c.transforms and c.file is not None
                    and c.byte_offset is not None and c.byte_length for c in t.chunks))


class RawSource:
    """``TensorSource`` yielding numpy arrays; see the module docstring."""

    raw_bytes = True  # writers may take the pieces as bytes (numpy arrays, not tensors)

    def __init__(self, reader: Reader, key_map: dict[str, str], sizes: dict[str, int]):
        self.reader = reader
        self.root = as_path(reader.metadata().root)
        self.key_map = key_map
        self.sizes = sizes
        self.largest_piece = 0
        self.tensors_done = 0
        self._per_key: dict[str, int] = {}
        self._chunks: dict[str, dict[tuple, ChunkRef]] = {}
        self._lock = threading.Lock()

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        import numpy as np

        meta = self.reader.metadata().tensors[self.key_map[key]]
        dt = np.dtype(_UINT[dtype_itemsize(meta.dtype)])
        out = np.empty(sizes, dtype=dt)
        covered = 0
        exact = self._exact(meta).get((tuple(offsets), tuple(sizes)))
        for chunk in (exact,) if exact is not None else meta.chunks:
            inter = [(max(o, c), min(o + n, c + m)) for o, n, c, m in
                     zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(lo >= hi for lo, hi in inter):
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), c in zip(inter, chunk.offsets))
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offsets))
            try:
                self._copy_chunk(chunk, meta.dtype, dt, src, out, dst)
            except NotSimple:  # an unusual item: this tensor goes through torch
                return self._through_torch(key, offsets, sizes, dt)
            except CorruptCheckpointError as exc:  # a damaged item: which tensor's
                if not exc.message.startswith("tensor "):
                    exc.message = f"tensor {meta.key}: {exc.message}"
                raise
            covered += int(np.prod([hi - lo for lo, hi in inter]))
        if covered < out.size:
            raise CorruptCheckpointError(f"tensor {meta.key}: stored chunks cover {covered} of "
                                         f"{out.size} requested elements", path=self.root)
        n = out.nbytes
        with self._lock:
            self.largest_piece = max(self.largest_piece, n)
            got = self._per_key.get(key, 0) + n
            self._per_key[key] = got
            if key in self.sizes and got >= self.sizes[key] > got - n:
                self.tensors_done += 1
        return out

    def _exact(self, meta: TensorMeta) -> dict[tuple, ChunkRef]:
        """``{(offsets, sizes): chunk}`` of the tensor's stored chunks (the usual request is
        one of them: found without scanning every chunk of the tensor)."""
        found = self._chunks.get(meta.key)
        if found is None:
            found = {}
            for c in meta.chunks:
                found.setdefault((tuple(c.offsets), tuple(c.sizes)), c)
            self._chunks[meta.key] = found
        return found

    def _through_torch(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                       dt: Any) -> Any:
        import torch

        from ckpt_tool.ops._source import ReaderSource

        t = ReaderSource(self.reader, self.key_map).read(key, offsets, sizes)
        return t.reshape(-1).view(torch.uint8).numpy().view(dt).reshape(sizes)

    def _copy_chunk(self, chunk: ChunkRef, dtype: str, dt: Any, src: tuple, out: Any,
                    dst: tuple) -> None:
        path = self.root / str(chunk.file)
        if is_remote(path):  # the item fetched (parallel ranged GETs) in place of a mapping
            fetched = Fetched(chunk.byte_length)
            if read_into(path, chunk.byte_offset, fetched) < chunk.byte_length:
                raise CorruptCheckpointError(f"data file {chunk.file} is truncated",
                                             path=self.root)
            self._copy_mapped(None, fetched, 0, chunk, dtype, dt, src, out, dst)
            return
        start = chunk.byte_offset - chunk.byte_offset % mmap.ALLOCATIONGRANULARITY
        with open(path, "rb") as f:
            if chunk.byte_offset + chunk.byte_length > os.fstat(f.fileno()).st_size:
                raise CorruptCheckpointError(f"data file {chunk.file} is truncated",
                                             path=self.root)
            mapped = mmap.mmap(f.fileno(), chunk.byte_offset + chunk.byte_length - start,
                               access=mmap.ACCESS_READ, offset=start)
            try:
                self._copy_mapped(f.fileno(), mapped, chunk.byte_offset - start, chunk, dtype,
                                  dt, src, out, dst)
            finally:
                mapped.close()

    def _copy_mapped(self, fd: int | None, mapped: Any, at: int, chunk: ChunkRef, dtype: str,
                     dt: Any, src: tuple, out: Any, dst: tuple) -> None:
        """Copy ``src`` of the item at ``at`` of ``mapped`` (of ``fd``; None: the item's
        bytes fetched from an object store) into ``out[dst]``, its CRC-32s checked first over
        the same bytes (for a mapping: the copy then finds its pages)."""
        import numpy as np

        raw = item = data = None
        try:
            with memoryview(mapped) as whole:
                item = whole[at:]
                records = None
                if self.reader.verify:  # every record's CRC-32 before a byte is copied
                    path = self.root / str(chunk.file)
                    what = (f"item at bytes [{chunk.byte_offset}, "
                            f"{chunk.byte_offset + chunk.byte_length})")
                    records = check_fetched(path, chunk.byte_offset, chunk.byte_length, item,
                                            what) if fd is None else \
                        check_item(fd, chunk.byte_offset, chunk.byte_length, item, what,
                                   path=path)
                raw = raw_item(item, records)
                if raw.dtype != dtype or raw.numel != math.prod(chunk.sizes):
                    raise IntegrityError(
                        f"the stored item of chunk at {list(chunk.offsets)} ({chunk.file}) "
                        f"holds {raw.numel} {raw.dtype} elements, the metadata says "
                        f"{math.prod(chunk.sizes)} {dtype}",
                        hint="the metadata contradicts the data: the checkpoint is damaged")
                size = dt.itemsize
                data = np.ndarray(raw.shape, dtype=dt, buffer=raw.data,
                                  offset=raw.storage_offset * size,
                                  strides=[s * size for s in raw.stride])
                if data.shape != tuple(chunk.sizes):
                    data = data.reshape(chunk.sizes)
                out[dst] = data[src]
        finally:  # every view released before the unmap, also on an error (else the
            del data  # BufferError of close() would hide it)
            for view in (None if raw is None else raw.data, item):
                if view is not None:
                    view.release()
