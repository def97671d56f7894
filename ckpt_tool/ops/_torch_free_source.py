"""A torch-free ``TensorSource`` for byte-moving conversions (DCP-based source -> safetensors).

When no dtype changes and every chunk of a tensor is a plain ``torch.save`` item, the bytes can
be moved without torch: each item is located in place over mmap (``formats.containers.torch_zip.torch_zip_read``); a
request for one stored chunk gets its elements in place, any other rectangle is assembled from
them with numpy. Pieces are numpy arrays of unsigned
integers of the element's size (the bytes are what matter); anything unusual falls back to the
torch path, per tensor. Skipping ``import torch`` (about 1 s) is most of a small conversion.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, IntegrityError
from ckpt_tool.formats.containers.torch_zip.archive_check import check_fetched, check_item
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import raw_item
from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import ChunkRef, TensorMeta, dtype_itemsize
from ckpt_tool.ops._mapped_ranges import Fetched
from ckpt_tool.planning.overlap import chunk_index
from ckpt_tool.storage import as_path, is_remote, read_into

__all__ = ["TorchFreeSource", "torch_free_source_applies"]

_UINT = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def torch_free_source_applies(reader: Reader, key_map: dict[str, str], dtypes: dict[str, str]) -> bool:
    """True when every selected tensor can be moved as raw bytes (no cast, DCP items)."""
    meta = reader.metadata()
    if dtypes or not meta.kind.dcp_files:
        return False
    return all(_movable(meta.tensors[k]) for k in key_map.values())


def _movable(t: TensorMeta) -> bool:
    return (t.stored_shape is None and bool(t.chunks) and dtype_itemsize(t.dtype) in _UINT
            and all(c.layout == "torch_save" and not c.transforms and c.file is not None
                    and c.byte_offset is not None and c.byte_length for c in t.chunks))


class TorchFreeSource:
    """``TensorSource`` yielding numpy arrays; see the module docstring.

    A request for exactly one stored chunk (a conversion keeping the chunk grid) gets the
    item's elements in place: a read-only array over the mapped item, no copy (the mapping
    goes when the array does). Other requests are assembled into a fresh array. Each data
    file is opened once (:meth:`close`, or when the source is collected)."""

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
        self._files: dict[str, tuple[int, int]] = {}  # name -> (descriptor, size)
        # (file, byte offset) -> (dtype, shape, stride, storage offset, data start, size):
        # what an item's zip records and pickle said, for the next request of the same item
        # (a reshard splitting a chunk reads it once per piece); bounded
        self._layouts: dict[tuple[str, int], tuple] = {}
        self._closer = weakref.finalize(self, _close_all, self._files)

    def close(self) -> None:
        """Close the data files opened so far (a later read opens them again)."""
        _close_all(self._files)

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        import numpy as np

        meta = self.reader.metadata().tensors[self.key_map[key]]
        dt = np.dtype(_UINT[dtype_itemsize(meta.dtype)])
        exact = self._exact(meta).get((tuple(offsets), tuple(sizes)))
        if exact is not None:
            try:
                out = self._in_place(exact, meta.dtype, dt)
            except NotSimple:  # an unusual item: this tensor goes through torch
                return self._through_torch(key, offsets, sizes, dt)
            except CorruptCheckpointError as exc:  # a damaged item: which tensor's
                if not exc.message.startswith("tensor "):
                    exc.message = f"tensor {meta.key}: {exc.message}"
                raise
            return self._count(key, out)
        out = np.empty(sizes, dtype=dt)
        covered = 0
        index = chunk_index(meta)  # only the chunks that can overlap the request
        for i in index.candidates(offsets, sizes):
            chunk = index.chunks[i]
            inter = [(max(o, c), min(o + n, c + m)) for o, n, c, m in
                     zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(lo >= hi for lo, hi in inter):
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), c in zip(inter, chunk.offsets))
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, offsets))
            try:
                out[dst] = self._in_place(chunk, meta.dtype, dt)[src]
            except NotSimple:  # an unusual item: this tensor goes through torch
                return self._through_torch(key, offsets, sizes, dt)
            except CorruptCheckpointError as exc:  # a damaged item: which tensor's
                if not exc.message.startswith("tensor "):
                    exc.message = f"tensor {meta.key}: {exc.message}"
                raise
            covered += math.prod(hi - lo for lo, hi in inter)
        if covered < out.size:
            raise CorruptCheckpointError(f"tensor {meta.key}: stored chunks cover {covered} of "
                                         f"{out.size} requested elements", path=self.root)
        return self._count(key, out)

    def _count(self, key: str, out: Any) -> Any:
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

    def _file(self, name: str) -> tuple[int, int]:
        got = self._files.get(name)
        if got is None:
            fd = os.open(self.root / name, os.O_RDONLY)
            got = (fd, os.fstat(fd).st_size)
            with self._lock:
                if name in self._files:  # another thread opened it meanwhile
                    os.close(fd)
                    return self._files[name]
                self._files[name] = got
        return got

    def _in_place(self, chunk: ChunkRef, dtype: str, dt: Any) -> Any:
        """The chunk's elements as a read-only array over the mapped item (in the chunk's
        shape; the mapping lives as long as the array), the item's CRC-32s checked first over
        the same mapping (the copy then finds its pages). The stored item is the ground truth:
        one that contradicts the metadata's dtype or element count is damage (IntegrityError).
        An object-store item is fetched into memory (ranged GETs) and checked the same way."""
        import numpy as np

        what = f"item at bytes [{chunk.byte_offset}, {chunk.byte_offset + chunk.byte_length})"
        path = self.root / str(chunk.file)
        if is_remote(path):  # the item fetched (parallel ranged GETs) in place of a mapping
            fetched = Fetched(chunk.byte_length)
            if read_into(path, chunk.byte_offset, fetched) < chunk.byte_length:
                raise CorruptCheckpointError(f"data file {chunk.file} is truncated",
                                             path=self.root)
            item = memoryview(fetched)
            records = check_fetched(path, chunk.byte_offset, chunk.byte_length, item,
                                    what) if self.reader.verify else None
        else:
            fd, size = self._file(str(chunk.file))
            if chunk.byte_offset + chunk.byte_length > size:
                raise CorruptCheckpointError(f"data file {chunk.file} is truncated",
                                             path=self.root)
            start = chunk.byte_offset - chunk.byte_offset % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(fd, chunk.byte_offset + chunk.byte_length - start,
                               access=mmap.ACCESS_READ, offset=start)
            item = memoryview(mapped)[chunk.byte_offset - start:]
            records = None
            if self.reader.verify:  # every record's CRC-32 before a byte is used
                records = check_item(fd, chunk.byte_offset, chunk.byte_length, item, what,
                                     path=path)
        where = (str(chunk.file), chunk.byte_offset)
        known = self._layouts.get(where)
        if known is None:
            raw = raw_item(item, records)
            known = (raw.dtype, raw.shape, raw.stride, raw.storage_offset,
                     raw.record.start, raw.record.size)
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            self._layouts[where] = known
        r_dtype, r_shape, r_stride, r_offset, start, nbytes = known
        raw = _Raw(r_dtype, r_shape, r_stride, r_offset, item[start:start + nbytes])
        if raw.dtype != dtype or raw.numel != math.prod(chunk.sizes):
            raise IntegrityError(
                f"the stored item of chunk at {list(chunk.offsets)} ({chunk.file}) holds "
                f"{raw.numel} {raw.dtype} elements, the metadata says "
                f"{math.prod(chunk.sizes)} {dtype}",
                hint="the metadata contradicts the data: the checkpoint is damaged")
        size = dt.itemsize
        data = np.ndarray(raw.shape, dtype=dt, buffer=raw.data,
                          offset=raw.storage_offset * size,
                          strides=[s * size for s in raw.stride])
        if data.shape != tuple(chunk.sizes):
            data = data.reshape(chunk.sizes)
        return data


_LAYOUTS = 1 << 15  # items whose layout is kept (~150 bytes each)


class _Raw:
    """The fields of a ``RawItem`` this module uses."""

    __slots__ = ("dtype", "shape", "stride", "storage_offset", "data")

    def __init__(self, dtype: str, shape: tuple, stride: tuple, storage_offset: int,
                 data: Any) -> None:
        self.dtype, self.shape, self.stride = dtype, shape, stride
        self.storage_offset, self.data = storage_offset, data

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _close_all(files: dict[str, tuple[int, int]]) -> None:
    while files:
        _name, (fd, _size) = files.popitem()
        os.close(fd)
