"""Moving bytes out of DCP ``.distcp`` files and assembling global tensors (imports torch).

Each stored DCP item is an independent ``torch.save`` archive at ``[offset, offset+length)`` of
its file; :func:`read_item_bytes` fetches that range. :func:`load_chunk` reads a tensor item in
place (``torch_zip_read``: zip records parsed with ``struct``, the tiny ``data.pkl`` through the
allowlist, the storage copied once into a fresh tensor) and falls back to ``torch.load`` of the
item's bytes through the allowlist when the item is unusual. :func:`assemble` builds a (sliced)
global tensor from a ``TensorMeta``'s chunks, for any chunk source, and undoes MCore's N-D
reformulation of flattened tensors.
"""

from __future__ import annotations

import io
import math
import mmap
import os
from pathlib import Path
from typing import Any, Callable

from ckpt_tool.errors import CorruptCheckpointError, IntegrityError, UnsupportedError, UsageError
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype
from ckpt_tool.model import ChunkRef, TensorMeta
from ckpt_tool.planning.overlap import chunk_index
from ckpt_tool.storage import is_remote, read_into

__all__ = ["read_item_bytes", "load_chunk", "load_chunk_view", "item_ranges", "normalize_slices",
           "assemble"]


def read_item_bytes(root: Path, file: str | None, offset: int | None, length: int | None, *,
                    verify: bool = True) -> bytes:
    """The stored bytes of one item; CorruptCheckpointError if the file is short or missing.
    ``verify``: the item is a ``torch.save`` archive whose CRC-32s are checked first
    (``archive_check``: IntegrityError), once per item."""
    if file is None or offset is None or length is None:
        raise CorruptCheckpointError("no storage location recorded for the item", path=root)
    path = root / file
    try:
        if is_remote(path):
            data = bytearray(length)
            del data[read_into(path, offset, data):]
            if verify and len(data) == length:
                from ckpt_tool.formats.containers.torch_zip.archive_check import check_fetched

                check_fetched(path, offset, length, data, _where(offset, length))
            data = bytes(data)
        else:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(length)
                if verify and len(data) == length:
                    from ckpt_tool.formats.containers.torch_zip.archive_check import check_item

                    check_item(f.fileno(), offset, length, data, _where(offset, length),
                               path=path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {file} is missing", path=root) from None
    if len(data) != length:
        raise CorruptCheckpointError(
            f"data file {file} is truncated: item at {offset} needs {length} bytes, "
            f"{len(data)} present", path=root)
    return data


def _where(offset: int, length: int) -> str:
    return f"item at bytes [{offset}, {offset + length})"


_PREAD_MAX = 1 << 20  # smaller items are read with one pread, bigger ones mapped


def _load_chunk_raw(path: Path, offset: int, length: int, copy: bool = True,
                    verify: bool = True) -> Any:
    """The item's tensor read in place, as a fresh tensor owning its memory (``copy=False``:
    a read-only view of the file that keeps its mapping alive until it is dropped); None when
    the raw path does not apply (missing/short file, unusual archive: the caller's fallback
    reports or handles it). ``verify``: the item's CRC-32s are checked before its bytes are
    used, over the same bytes (IntegrityError)."""
    from ckpt_tool.formats.containers.torch_zip.archive_check import check_item
    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import (as_byte_view, as_tensor,
                                                                       frombuffer_u8, raw_item)
    from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple

    if is_remote(path):
        return _load_chunk_fetched(path, offset, length, verify=verify)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if length <= 0 or offset < 0 or offset + length > os.fstat(fd).st_size:
            return None
        if length <= _PREAD_MAX:
            data = os.pread(fd, length, offset)
            records = check_item(fd, offset, length, data, _where(offset, length),
                                 path=path) if verify else None
            try:
                return as_tensor(raw_item(data, records), copy=copy)
            except NotSimple:
                return None
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fd, offset + length - start, access=mmap.ACCESS_READ, offset=start)
        view = memoryview(mapped)
        try:
            with view[offset - start:] as item:
                records = check_item(fd, offset, length, item, _where(offset, length),
                                     path=path) if verify else None
        except BaseException:
            view.release()
            mapped.close()
            raise
    finally:
        os.close(fd)
    if not copy:
        view.release()
        try:
            raw = raw_item(memoryview(mapped)[offset - start:], records)
        except NotSimple:
            return None
        if frombuffer_u8(raw.data).data_ptr() % raw.itemsize:
            return ByteView(as_byte_view(raw), torch_dtype(raw.dtype))
        return as_tensor(raw, copy=False)
    try:
        with view[offset - start:] as item:
            raw = raw_item(item, records)
            try:
                return as_tensor(raw, copy=True)
            finally:
                raw.data.release()
    except NotSimple:
        return None
    finally:
        view.release()
        try:
            mapped.close()
        except BufferError:  # a view still alive somewhere: the GC unmaps it later
            pass


def _load_chunk_fetched(path: Any, offset: int, length: int, *, verify: bool) -> Any:
    """:func:`_load_chunk_raw` of an object-store item: its bytes fetched (parallel ranged
    GETs) into a private buffer and checked as a local item's are, the tensor a view of it
    (never shared with anything else); None when the item is short or unusual (the caller's
    fallback reports or handles it)."""
    from ckpt_tool.formats.containers.torch_zip.archive_check import check_fetched
    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import as_tensor, raw_item
    from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple

    if length <= 0 or offset < 0:
        return None
    buf = bytearray(length)
    try:
        if read_into(path, offset, buf) != length:
            return None
    except FileNotFoundError:
        return None
    records = check_fetched(path, offset, length, buf, _where(offset, length)) \
        if verify else None
    try:
        return as_tensor(raw_item(buf, records))
    except NotSimple:
        return None


class ByteView:
    """A stored tensor read in place whose elements are not aligned to their size (a DCP item
    starts at any byte of its file): ``data`` holds its bytes, shape ``(*shape, itemsize)``.
    :func:`assemble` copies the region it needs byte-wise, so a slice of a big misaligned chunk
    costs the slice, not a copy of the whole chunk."""

    def __init__(self, data: Any, dtype: Any):
        self.data, self.dtype = data, dtype
        self.shape = tuple(data.shape[:-1])

    def materialize(self) -> Any:
        """An aligned tensor of its own (a copy)."""
        import torch

        out = torch.empty(self.shape, dtype=self.dtype)
        as_bytes(out).copy_(self.data)
        return out


def as_bytes(t: Any) -> Any:
    """The bytes of the contiguous tensor ``t`` as a uint8 view of shape ``(*t.shape,
    itemsize)``."""
    import torch

    return t.reshape(-1).view(torch.uint8).view(*t.shape, t.element_size())


def load_chunk(root: Path, chunk: ChunkRef, *, trust: bool = False, verify: bool = True) -> Any:
    """One stored chunk as a torch.Tensor (a ``torch.save`` item of a ``.distcp`` file).

    The tensor is always a private copy that owns its memory (writable, never aliasing the
    file, no mapping kept open): read in place when the item is a plain tensor archive (one
    copy of the data), else through ``torch.load`` of the item's bytes via the allowlist.
    ``verify``: the item's CRC-32s are checked before its bytes are used (IntegrityError).
    """
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    if chunk.transforms:
        raise UnsupportedError(f"stream transforms {list(chunk.transforms)} are not supported yet")
    if chunk.file is not None and chunk.byte_offset is not None \
            and chunk.byte_length is not None:
        t = _load_chunk_raw(root / chunk.file, chunk.byte_offset, chunk.byte_length,
                            verify=verify)
        if t is not None:
            return t
    data = read_item_bytes(root, chunk.file, chunk.byte_offset, chunk.byte_length,
                           verify=verify)
    try:
        return load_torch_file(io.BytesIO(data), trust=trust, verify=False)  # (checked)
    except CorruptCheckpointError as exc:
        exc.path = exc.path or str(root / str(chunk.file))
        raise


def load_chunk_view(root: Path, chunk: ChunkRef, *, trust: bool = False,
                    verify: bool = True) -> Any:
    """Like :func:`load_chunk` but, for plain tensor items, a read-only zero-copy view of the
    file (a :class:`ByteView` when its elements are misaligned): only for callers that copy
    what they need at once (``assemble``) and never write into it."""
    if not chunk.transforms and chunk.file is not None and chunk.byte_offset is not None \
            and chunk.byte_length is not None:
        t = _load_chunk_raw(root / chunk.file, chunk.byte_offset, chunk.byte_length, copy=False,
                            verify=verify)
        if t is not None:
            return t
    return load_chunk(root, chunk, trust=trust, verify=verify)


def item_ranges(root: Path, chunks: Any) -> list[tuple[Path, int, int]]:
    """``(file, offset, length)`` of the ``torch.save`` items storing ``chunks`` (those with a
    byte range and no stream transform), for ``archive_check.check_many``."""
    return list(dict.fromkeys(
        (root / c.file, c.byte_offset, c.byte_length) for c in chunks
        if c.file and c.byte_offset is not None and c.byte_length
        and not c.transforms and c.layout in ("torch_save", "flat")))


def normalize_slices(shape: tuple[int, ...], slices: tuple[slice, ...] | None
                     ) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` per dimension for contiguous ``slices`` (missing trailing dims: full)."""
    slices = tuple(slices or ())
    if len(slices) > len(shape):
        raise UsageError(f"{len(slices)} slices for a {len(shape)}-D tensor")
    out = []
    for dim, size in enumerate(shape):
        s = slices[dim] if dim < len(slices) else slice(None)
        if not isinstance(s, slice):
            raise UsageError(f"dimension {dim}: only slice objects are supported, got {s!r}")
        start, stop, step = s.indices(size)
        if step != 1:
            raise UsageError(f"dimension {dim}: slices with a step are not supported")
        out.append((start, max(start, stop)))
    return tuple(out)


def _reshapeable(meta: TensorMeta, chunk: ChunkRef, data: Any) -> bool:
    """True when the stored piece ``data`` has as many elements as ``chunk`` says (a flat or
    otherwise shaped copy of it); else the metadata contradicts the item:
    CorruptCheckpointError, never a reshape's RuntimeError."""
    if math.prod(data.shape) != chunk.numel:
        where = f" ({chunk.file})" if chunk.file else ""
        raise CorruptCheckpointError(
            f"tensor {meta.key}: the stored item of chunk at {list(chunk.offsets)}{where} holds "
            f"{list(data.shape)}, the metadata says {list(chunk.sizes)}",
            hint="the metadata contradicts the data: the checkpoint is damaged")
    return True


def _unflatten(stored: Any, logical: tuple[int, ...]) -> Any:
    """Undo MCore's N-D reformulation: ``[X//x, .., x*y*..]`` -> ``[X, Y, ..]``."""
    grid = tuple(stored.shape[:-1])
    local = tuple(g // n for g, n in zip(logical, grid))
    if math.prod(local) != stored.shape[-1]:
        raise CorruptCheckpointError(
            f"reformulated shape {list(stored.shape)} does not match the logical shape "
            f"{list(logical)}")
    nd = len(logical)
    t = stored.reshape(*grid, *local)
    order = [i for d in range(nd) for i in (d, nd + d)]
    return t.permute(*order).reshape(*logical)


def _load_checked(meta: TensorMeta, chunk: ChunkRef, load: Callable[[ChunkRef], Any],
                  dtype: Any) -> Any:
    """``load(chunk)``, which must hold what the metadata says: ``dtype`` elements, as many
    as the chunk has. The stored item is the ground truth: data that contradicts the metadata
    is never cast or reshaped into what it claims to be (IntegrityError); a damaged item's
    error names the tensor."""
    try:
        data = load(chunk)
    except CorruptCheckpointError as exc:  # a damaged item: which tensor's
        if not exc.message.startswith("tensor "):
            exc.message = f"tensor {meta.key}: {exc.message}"
        raise
    numel = math.prod(data.shape)
    if data.dtype != dtype or numel != chunk.numel:
        where = f" ({chunk.file})" if chunk.file else ""
        held = str(data.dtype).removeprefix("torch.")
        raise IntegrityError(
            f"tensor {meta.key}: the stored item of chunk at {list(chunk.offsets)}{where} holds "
            f"{numel} {held} elements, the metadata says {chunk.numel} {meta.dtype}",
            hint="the metadata contradicts the data: the checkpoint is damaged")
    return data


def assemble(meta: TensorMeta, slices: tuple[slice, ...] | None,
             load: Callable[[ChunkRef], Any]) -> Any:
    """The global tensor ``meta`` (or a region of it) from its chunks; ``load(chunk)`` returns
    the chunk's tensor with ``chunk.sizes`` elements of the tensor's dtype (else
    IntegrityError: the stored data contradicts the metadata)."""
    import torch

    if meta.stored_shape is not None:
        stored = assemble(TensorMeta(meta.key, meta.dtype, meta.stored_shape, meta.chunks),
                          None, load)
        full = _unflatten(stored, meta.shape)
        region = normalize_slices(meta.shape, slices)
        return full[tuple(slice(a, b) for a, b in region)].clone()
    region = normalize_slices(meta.shape, slices)
    out = torch.empty([b - a for a, b in region], dtype=torch_dtype(meta.dtype))
    covered = 0
    index = chunk_index(meta)  # the chunks that can overlap the region, not all of them
    for chunk in (index.chunks[i] for i in index.candidates([a for a, _ in region],
                                                            [b - a for a, b in region])):
        inter = []
        for (a, b), off, size in zip(region, chunk.offsets, chunk.sizes):
            lo, hi = max(a, off), min(b, off + size)
            if lo >= hi:
                break
            inter.append((lo, hi))
        else:
            data = _load_checked(meta, chunk, load, out.dtype)
            src = tuple(slice(lo - off, hi - off) for (lo, hi), off in zip(inter, chunk.offsets))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, region))
            if isinstance(data, ByteView):
                if data.dtype == out.dtype and data.shape == tuple(chunk.sizes):
                    as_bytes(out)[dst] = data.data[src]  # only the region, byte-wise
                    del data  # the file's mapping goes now
                    covered += math.prod(hi - lo for lo, hi in inter)
                    continue
                data = data.materialize()
            if tuple(data.shape) != tuple(chunk.sizes) and _reshapeable(meta, chunk, data):
                data = data.reshape(chunk.sizes)
            out[dst] = data[src]
            del data
            covered += math.prod(hi - lo for lo, hi in inter)
    if covered < out.numel():
        raise CorruptCheckpointError(
            f"tensor {meta.key}: stored chunks cover {covered} of {out.numel()} requested "
            "elements")
    return out
