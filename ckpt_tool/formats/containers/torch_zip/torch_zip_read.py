"""Reading ``torch.save`` archives in place: zip records and zero-copy tensor views.

DCP stores every tensor item as one independent ``torch.save`` zip at ``[offset,
offset+length)`` of a ``.distcp`` file; Megatron-LM legacy rank files are whole ``torch.save``
zips. Given that archive as a buffer (a memoryview of a read-only mmap, or bytes):

* ``zip_directory.zip_records`` lists its records (name, where the data starts, size, CRC32)
  as PyTorch's reader would find them;
* :func:`raw_item` describes the one tensor of a DCP item (dtype, shape, stride, storage
  offset and a zero-copy memoryview of its storage record); its tiny ``data.pkl`` is unpickled
  by the allowlisting unpickler with the torch-free stand-ins (cached by content: layers repeat);
* :func:`as_tensor` turns that into a ``torch.Tensor`` without copying when it can;

Anything unusual (compressed or encrypted records, a big-endian archive, several storages,
tensor subclasses, a pickle needing real torch, bounds that do not fit) raises
:class:`NotSimple`: the caller falls back to ``torch.load`` through the allowlist
(``_dcp_io.load_chunk``), which gives the authoritative result or error.

Aliasing: a view from :func:`as_tensor` shares memory with the buffer. Over a read-only mmap
it must never be written to (the write would fault; the file itself cannot change): code that
hands tensors to callers uses ``copy=True`` (``_dcp_io.load_chunk`` does).
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ckpt_tool.errors import UnsupportedError
from ckpt_tool.formats.containers.torch_zip.zip_directory import (NotSimple, TorchRejects,
                                                                  ZipRecord, zip_records)
from ckpt_tool.model import DTYPE_ITEMSIZE

__all__ = ["RawItem", "raw_item", "as_tensor", "as_byte_view", "frombuffer_u8", "torch_dtype"]


def torch_dtype(name: str) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class RawItem:
    """The one tensor of a ``torch.save`` archive, in place: element ``[i, j, ..]`` is at
    element ``storage_offset + i*stride[0] + j*stride[1] + ..`` of ``data`` (little-endian
    ``dtype``); ``data`` is the storage record's bytes (a view, not a copy)."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    data: memoryview
    record: ZipRecord

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    def dense_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` element range of the storage that the tensor covers exactly once
        (any order of dimensions), or None when it skips or repeats elements."""
        expect = 1
        for st, size in sorted((st, s) for s, st in zip(self.shape, self.stride) if s != 1):
            if size == 0:
                return self.storage_offset, self.storage_offset
            if st != expect:
                return None
            expect *= size
        return self.storage_offset, self.storage_offset + self.numel


@lru_cache(maxsize=4096)
def _describe(pkl: bytes) -> tuple[str, tuple[int, ...], tuple[int, ...], int, str, int, str]:
    """``(dtype, shape, stride, storage offset, storage key, storage nbytes, storage dtype)``
    of the tensor a DCP item's ``data.pkl`` rebuilds (cached: the bytes say it all)."""
    from ckpt_tool.formats.containers.pickle.safe_pickle import SafeUnpickler
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import (StoragePlaceholder,
                                                                     TensorPlaceholder,
                                                                     torch_free_fallback)

    def persistent_load(pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            return StoragePlaceholder(str(pid[1]), int(pid[4]), str(pid[2]))
        raise NotSimple(f"persistent id {pid!r}")

    try:
        t = SafeUnpickler(io.BytesIO(pkl), fallback=torch_free_fallback,
                          persistent_load=persistent_load, encoding="utf-8").load()
    except Exception as exc:  # noqa: BLE001 - anything unusual goes to torch.load
        raise NotSimple(f"data.pkl: {type(exc).__name__}: {exc}") from None
    if not isinstance(t, TensorPlaceholder) or t.storage is None or t.stride is None \
            or len(t.stride) != len(t.shape) or t.dtype not in DTYPE_ITEMSIZE \
            or t.storage.dtype not in DTYPE_ITEMSIZE:
        raise NotSimple("data.pkl does not hold one plain tensor")
    nbytes = t.storage.numel * DTYPE_ITEMSIZE[t.storage.dtype]
    return (str(t.dtype), tuple(int(s) for s in t.shape), t.stride, t.storage_offset,
            t.storage.key, nbytes, str(t.storage.dtype))


def raw_item(buf: Any, records: list[ZipRecord] | None = None) -> RawItem:
    """The tensor of the ``torch.save`` archive ``buf`` (``records``: its
    :func:`zip_records`, if already parsed); NotSimple when the raw path does not apply."""
    records = zip_records(buf) if records is None else records
    by_name = {r.name: r for r in records}
    pkls = sorted((r.name for r in records if r.name.endswith("data.pkl")), key=len)
    if not pkls or not by_name[pkls[0]].stored:
        raise NotSimple("no stored data.pkl")
    prefix = pkls[0][:-len("data.pkl")]
    order = by_name.get(prefix + "byteorder")
    if order is not None and (not order.stored or bytes(
            buf[order.start:order.start + order.size]).strip() != b"little"):
        raise NotSimple("not a little-endian archive")
    pkl = by_name[pkls[0]]
    dtype, shape, stride, offset, key, nbytes, _ = _describe(
        bytes(buf[pkl.start:pkl.start + pkl.size]))
    rec = by_name.get(f"{prefix}data/{key}")
    if rec is None:  # what torch.load fails on ("file not found")
        raise TorchRejects(f"P7: the pickle's storage data/{key} has no record")
    if not rec.stored or rec.size != nbytes:
        raise NotSimple(f"storage record data/{key} is compressed or mis-sized")
    itemsize = DTYPE_ITEMSIZE[dtype]
    if nbytes % itemsize or any(s < 0 for s in shape) or any(st < 0 for st in stride):
        raise NotSimple("storage does not hold whole elements")
    if math.prod(shape) and offset + sum((s - 1) * st for s, st in zip(shape, stride)) \
            >= nbytes // itemsize:
        raise NotSimple("tensor reaches past its storage")
    return RawItem(dtype, shape, tuple(stride), offset,
                   memoryview(buf)[rec.start:rec.start + rec.size], rec)


_PRIMED = threading.Lock()
_primed = False


def frombuffer_u8(data: Any) -> Any:
    """``torch.frombuffer(data, dtype=uint8)``, also for empty and read-only buffers. Torch
    warns once per process about read-only buffers; that warning is silenced here (the views
    made in this package are never written to)."""
    global _primed
    import torch

    if len(data) == 0:
        return torch.empty(0, dtype=torch.uint8)
    if not _primed:
        with _PRIMED:
            if not _primed:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    torch.frombuffer(memoryview(b"\0"), dtype=torch.uint8)
                _primed = True
    return torch.frombuffer(data, dtype=torch.uint8)


def as_tensor(raw: RawItem, *, copy: bool = False) -> Any:
    """``raw`` as a ``torch.Tensor`` with the pickled shape, stride and storage offset.

    Zero-copy (aliasing ``raw.data``) unless ``copy`` or the data is not aligned to the
    element size (DCP items sit at arbitrary file offsets; misaligned element access is not
    safe for every kernel): then the storage is copied into a fresh, writable tensor that
    owns its memory.
    """
    import torch


    dt = torch_dtype(raw.dtype)
    u8 = frombuffer_u8(raw.data)
    if copy or u8.data_ptr() % raw.itemsize:
        base = torch.empty(len(raw.data) // raw.itemsize, dtype=dt)
        base.view(torch.uint8).copy_(u8)
    else:
        base = u8.view(dt)
    return base.as_strided(raw.shape, raw.stride, raw.storage_offset)


def as_byte_view(raw: RawItem) -> Any:
    """``raw``'s bytes in place as a uint8 tensor of shape ``(*shape, itemsize)`` (element
    ``[i, j, ..]`` is row ``[i, j, ..]``): safe to copy from whatever the data's alignment,
    since only bytes are accessed; never a copy."""
    n = raw.itemsize
    return frombuffer_u8(raw.data).as_strided(
        (*raw.shape, n), (*(st * n for st in raw.stride), 1), raw.storage_offset * n)
