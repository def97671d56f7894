"""``torch.save`` files as a whole, shared by the torch_save and legacy formats (no torch).

:func:`flatten_state` keys the tensors of an unpickled state by dotted path;
:func:`zip_storages` finds each storage record's data in the zip (uncompressed records only);
:func:`placeholder_chunk` turns a tensor placeholder into a raw byte range of the file.
"""

from __future__ import annotations

import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError
from ckpt_tool.model import ChunkRef, dtype_itemsize

__all__ = ["ZIP_MAGIC", "LEGACY_MAGIC", "mmap_safe", "flatten_state", "zip_storages", "zip_data_offsets",
           "placeholder_chunk"]

ZIP_MAGIC = b"PK\x03\x04"
# A legacy torch.save file starts with the pickled magic number 0x1950a86a20f9469cfc6c.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"
def _is_tensor(v: Any) -> bool:
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import TensorPlaceholder

    if isinstance(v, TensorPlaceholder):
        return True
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, others)``: leaves of nested dicts/lists/tuples keyed by dotted path."""
    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}

    def walk(v: Any, key: str) -> None:
        if _is_tensor(v):
            tensors[key or "<root>"] = v
        elif isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, (list, tuple)) and v and any(_holds_tensor(x) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{key}.{i}" if key else str(i))
        else:
            others[key or "<root>"] = v

    walk(obj, prefix)
    return tensors, others


def _holds_tensor(v: Any) -> bool:
    if _is_tensor(v):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def zip_storages(path: Path) -> tuple[str, dict[str, tuple[int, int]], str]:
    """``(archive prefix, {storage key: (data offset, size)}, byteorder)`` of a torch.save zip."""
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
            pkls = sorted((n for n in zf.namelist() if n.endswith("/data.pkl")), key=len)
            if not pkls:
                raise CorruptCheckpointError("zip file without */data.pkl: not a torch.save file",
                                             path=path)
            prefix = pkls[0][: -len("data.pkl")]
            byteorder = "little"
            if prefix + "byteorder" in zf.NameToInfo:
                byteorder = zf.read(prefix + "byteorder").decode("ascii", "replace").strip()
            offsets = {}
            for info in zf.infolist():
                if not info.filename.startswith(prefix + "data/"):
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    continue  # no raw byte range; reads go through torch.load
                offsets[info.filename[len(prefix + "data/"):]] = (
                    zip_data_offsets(raw, info.header_offset), info.file_size)
    except (zipfile.BadZipFile, OSError, EOFError, struct.error) as exc:
        raise CorruptCheckpointError(f"damaged zip archive ({exc})", path=path) from None
    return prefix, offsets, byteorder


def mmap_safe(path: Path) -> bool:
    """Whether ``torch.load(path, mmap=True)`` reads the right bytes: every record stored
    uncompressed. (Its mmap path maps each storage at its record's data offset in the file;
    a deflate-compressed record there is its compressed bytes, loaded silently as values:
    such a file is loaded without mmap, which inflates.)"""
    try:
        with zipfile.ZipFile(path) as zf:
            return all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    except (zipfile.BadZipFile, OSError, EOFError):
        return True  # the load reports the damage


def zip_data_offsets(raw: Any, header_offset: int) -> int:
    """Where an entry's data starts: after its local file header (30 bytes + name + extra)."""
    raw.seek(header_offset)
    head = raw.read(30)
    if len(head) != 30 or head[:4] != ZIP_MAGIC:
        raise zipfile.BadZipFile(f"bad local file header at {header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return header_offset + 30 + name_len + extra_len


def _check_extent(path: Path, key: str, t: Any, shape: tuple[int, ...],
                  contiguous: list[int], size: int) -> None:
    strides = list(t.stride) if t.stride is not None else contiguous
    if math.prod(shape) == 0:
        return
    if len(strides) != len(shape) or any(int(st) < 0 for st in strides) or t.storage_offset < 0:
        raise CorruptCheckpointError(f"tensor {key!r}: strides {strides} do not fit its shape "
                                     f"{list(shape)}", path=path)
    last = int(t.storage_offset) + sum((n - 1) * int(st) for n, st in zip(shape, strides))
    need = (last + 1) * dtype_itemsize(t.dtype)
    if need > size:
        raise CorruptCheckpointError(
            f"tensor {key!r}: shape {list(shape)} needs {need} bytes of storage "
            f"{t.storage.key}, which holds {size} (torch.load refuses it)", path=path)


def placeholder_chunk(path: Path, key: str, t: Any, shape: tuple[int, ...],
                      storages: dict[str, tuple[int, int]], byteorder: str) -> ChunkRef | None:
    """A raw ChunkRef for a contiguous little-endian tensor, else ``None``. A view (any
    strides) reaching beyond its storage is CorruptCheckpointError: ``torch.load`` refuses it
    too, and nothing may size an allocation by its shape."""
    if t.storage is None or t.storage.key not in storages:
        return None
    expect, stride = 1, []
    for s in reversed(shape):
        stride.insert(0, expect)
        expect *= s
    numel = math.prod(shape)
    _check_extent(path, key, t, shape, stride, storages[t.storage.key][1])
    if byteorder != "little":
        return None
    if t.stride is not None and numel > 1 and any(
            st != e for st, e, s in zip(t.stride, stride, shape) if s > 1):
        return None
    itemsize = dtype_itemsize(t.dtype)
    data_offset, size = storages[t.storage.key]
    start, length = t.storage_offset * itemsize, numel * itemsize
    if start + length > size:
        raise CorruptCheckpointError(
            f"tensor {key!r}: needs bytes [{start}, {start + length}) of storage "
            f"{t.storage.key}, which holds {size}", path=path)
    return ChunkRef(offsets=(0,) * len(shape), sizes=shape, file=path.name,
                    byte_offset=data_offset + start, byte_length=length, layout="raw")
