"""Reading a DCP ``.metadata`` file safely, with or without torch.

* :func:`read_dcp_metadata` returns the real ``torch.distributed.checkpoint.metadata.Metadata``
  (drop-in for ``FileSystemReader.read_metadata``) unpickled through the allowlist; MCore's
  pickled ``MCoreSavePlan``/``MCoreMetadata`` become :class:`MCoreSavePlan`/:class:`MCoreMetadata`,
  our subclasses of the torch classes that keep ``mcore_data``. Megatron is never imported.
* :func:`read_dcp_metadata_torch_free` returns attribute-compatible stand-ins without importing
  torch (the ``ckpt inspect`` path); it falls back to torch only for a global it cannot mimic.
* :func:`dcp_tensor_metas` maps either kind into ``TensorMeta``/``ObjectMeta``.
"""

from __future__ import annotations

import copyreg
import functools
import math
import os
import re
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.regular_files import inside_name
from ckpt_tool.formats.containers.pickle.safe_pickle import safe_load
from ckpt_tool.model import ChunkRef, ObjectMeta, TensorMeta
from ckpt_tool.storage import as_path, open_read

__all__ = ["metadata_path", "read_dcp_metadata", "read_dcp_metadata_torch_free", "dcp_tensor_metas",
           "mcore_classes", "METADATA_FILE", "data_file_name"]

METADATA_FILE = ".metadata"
_MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


def metadata_path(checkpoint_dir: str | os.PathLike, rank: int | None = None) -> Path:
    """The ``.metadata`` (or per-rank ``__{rank}.metadata``) file of a DCP checkpoint.

    ``checkpoint_dir`` may also be the metadata file itself.
    """
    p = as_path(checkpoint_dir)
    if p.is_file() and p.name.endswith(".metadata"):
        return p
    if not p.exists():
        raise InputError("no such file or directory", path=p, hint="check the path")
    if rank is not None:
        return p / f"__{rank}.metadata"
    md = p / METADATA_FILE
    if not md.exists():
        per_rank = sorted(x.name for x in p.glob("__*.metadata"))
        if per_rank:
            return p / per_rank[0]
        raise InputError(f"no {METADATA_FILE} file", path=p,
                         hint="not a complete DCP checkpoint: the save may have been interrupted")
    return md


def _open_checked(path: Path) -> Any:
    if not path.is_file():
        raise InputError(f"no {path.name} file", path=path.parent,
                         hint="not a complete DCP checkpoint: the save may have been interrupted")
    if path.stat().st_size == 0:
        raise CorruptCheckpointError("empty metadata file (zero bytes)", path=path,
                                     hint="the save was interrupted; use an earlier checkpoint")
    return open_read(path)


@functools.cache
def mcore_classes() -> dict[str, type]:
    """Our torch subclasses standing in for MCore's pickled DCP classes (imports torch)."""
    from dataclasses import dataclass

    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan

    @dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):
        """Stand-in for ``megatron...strategies.torch.MCoreSavePlan``: a SavePlan + mcore_data."""

        mcore_data: Any = None

    @dataclass
    class MCoreMetadata(Metadata):
        """Stand-in for ``megatron...strategies.torch.MCoreMetadata``: Metadata + mcore_data."""

        mcore_data: Any = None

    for cls in (MCoreSavePlan, MCoreMetadata):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        cls.__reduce__ = _reduce_as_torch_base
    return {f"{_MCORE_TORCH}.MCoreSavePlan": MCoreSavePlan,
            f"{_MCORE_TORCH}.MCoreMetadata": MCoreMetadata}


def _reduce_as_torch_base(self: Any) -> tuple:
    # Pickled as the torch base class with every field, mcore_data included as an attribute:
    # Megatron-Core and we both load that, while this stand-in has no importable class path.
    return copyreg._reconstructor, (type(self).__bases__[0], object, None), dict(self.__dict__)


def read_dcp_metadata(checkpoint_dir: str | os.PathLike, *, trust: bool = False,
                      rank: int | None = None) -> Any:
    """The real DCP ``Metadata`` of ``checkpoint_dir`` via the allowlisting unpickler.

    Raises InputError (no metadata file), CorruptCheckpointError (empty, truncated, garbage or
    not a Metadata) or UnsafePickleError (a global outside the allowlist; ``trust=True``
    unpickles without it, MCore classes still mapped to our stand-ins).
    """
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    path = metadata_path(checkpoint_dir, rank)
    with _open_checked(path) as f:
        md = safe_load(f, trust=trust, where=path, overrides=mcore_classes())
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(
            f"does not hold DCP Metadata (found {type(md).__name__})", path=path)
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    _check_storage_paths(md, path)
    return md


def read_dcp_metadata_torch_free(checkpoint_dir: str | os.PathLike, *, trust: bool = False,
                            rank: int | None = None) -> Any:
    """DCP metadata as torch-free stand-ins (same attribute names as the torch classes).

    dtypes come back as ``DtypeName`` strings and sizes as tuples. If the pickle needs a torch
    global that has no stand-in, this falls back to :func:`read_dcp_metadata` (imports torch).
    """
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import NeedsTorch, torch_free_fallback

    path = metadata_path(checkpoint_dir, rank)
    try:
        with _open_checked(path) as f:
            md = safe_load(f, trust=trust, where=path, fallback=_raise_needs_torch(
                torch_free_fallback, NeedsTorch))
    except _NeedsTorchSignal:
        return read_dcp_metadata(checkpoint_dir, trust=trust, rank=rank)
    if not hasattr(md, "state_dict_metadata") or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(
            f"does not hold DCP Metadata (found {_type_name(md)})", path=path)
    _check_storage_paths(md, path)
    return md


def _check_storage_paths(md: Any, path: Path) -> None:
    """Every storage entry names a data file inside the checkpoint (see data_file_name), so
    no reader (ours, or torch's FileSystemReader given this Metadata) opens one outside."""
    storage = getattr(md, "storage_data", None) or {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError("storage_data is not a mapping", path=path)
    for idx, info in storage.items():
        try:
            data_file_name(getattr(info, "relative_path", None), getattr(idx, "fqn", idx))
        except CorruptCheckpointError as exc:
            exc.path = str(path)
            raise


class _NeedsTorchSignal(BaseException):
    """Escapes safe_load's error translation (it is not an Exception)."""


def _raise_needs_torch(fallback: Any, needs_torch: type) -> Any:
    def wrapped(module: str, name: str) -> Any:
        try:
            return fallback(module, name)
        except needs_torch:
            raise _NeedsTorchSignal from None
    return wrapped


def _type_name(obj: Any) -> str:
    return getattr(type(obj), "__stand_in_for__", type(obj).__name__)




def dcp_tensor_metas(md: Any, *, mcore_data: dict[str, Any] | None = None
                     ) -> tuple[dict[str, TensorMeta], list[ObjectMeta]]:
    """Map DCP metadata (torch or torch-free) into TensorMeta per key and ObjectMeta per bytes item.

    ``mcore_data[key]["nd_reformulated_orig_global_shape"]`` marks MCore's N-D reformulated
    flattened tensors: their ``shape`` is the logical one, ``stored_shape`` the DCP one, and
    the chunks (layout ``"flat"``) are in stored coordinates.
    """
    if mcore_data is None:
        mcore_data = getattr(md, "mcore_data", None) or {}
    storage = {}
    for idx, info in (getattr(md, "storage_data", None) or {}).items():
        off = getattr(idx, "offset", None)
        storage[(idx.fqn, None if off is None else tuple(off))] = info
    tensors: dict[str, TensorMeta] = {}
    objects: list[ObjectMeta] = []
    for key, item in md.state_dict_metadata.items():
        if not hasattr(item, "chunks"):
            info = storage.get((key, None))
            objects.append(_object_meta(key, info))
            continue
        dtype = _dtype_str(_checked_dtype(getattr(item.properties, "dtype", None), key))
        size = _ints(item.size, "size", key)
        orig = (mcore_data.get(key) or {}).get("nd_reformulated_orig_global_shape")
        layout = "flat" if orig is not None else "torch_save"
        chunks = []
        for ch in item.chunks:
            offsets = _ints(ch.offsets, "chunk offsets", key)
            info = storage.get((key, offsets))
            chunks.append(ChunkRef(
                offsets=offsets, sizes=_ints(ch.sizes, "chunk sizes", key),
                file=None if info is None else data_file_name(info.relative_path, key),
                byte_offset=None if info is None else _ints(
                    [info.offset], "storage offset", key)[0],
                byte_length=None if info is None else _ints(
                    [info.length], "storage length", key)[0],
                transforms=tuple(getattr(info, "transform_descriptors", None) or ()),
                layout=layout))
        chunks.sort(key=lambda c: c.offsets)
        if orig is not None and math.prod(orig) != math.prod(size):
            raise CorruptCheckpointError(
                f"tensor {key}: reformulated shape {list(size)} does not hold the original "
                f"shape {list(orig)}")
        tensors[key] = TensorMeta(
            key=key, dtype=dtype, shape=tuple(int(s) for s in orig) if orig else size,
            chunks=tuple(chunks), stored_shape=size if orig is not None else None,
            origin=_origin(md, key))
    objects.sort(key=lambda o: (o.key, o.global_offset, o.unique_key))
    return tensors, objects


def data_file_name(name: Any, key: str) -> str:
    """A storage ``relative_path`` checked to stay inside the checkpoint directory (see
    :func:`ckpt_tool.formats.regular_files.inside_name`)."""
    return inside_name(name, f"item {key}: its data file", ".metadata")


_INT64 = 1 << 63


def _ints(values: Any, what: str, key: str) -> tuple[int, ...]:
    """``values`` (a torch.Size, a tuple) as a tuple of ints, each an int of int64's range
    and not negative, as torch builds tensors and reads bytes from them; anything else (a
    float ``8.0``, a string, ``2**70``) is CorruptCheckpointError naming the field."""
    try:
        out = tuple(values)
    except TypeError:
        out = None
    if out is None or not all(type(v) is int and 0 <= v < _INT64 for v in out):
        shown = repr(values)[:80]
        raise CorruptCheckpointError(
            f"tensor {key}: {what} {shown} are not non-negative int64 integers "
            "(torch refuses them)", hint=".metadata is damaged")
    return out


def _checked_dtype(dtype: Any, key: str) -> Any:
    """A torch dtype (torch-free: a ``DtypeName``); a plain string or anything else is what
    torch cannot build a tensor of: CorruptCheckpointError."""
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import DtypeName

    if isinstance(dtype, DtypeName) or type(dtype).__module__ == "torch" \
            and type(dtype).__name__ == "dtype":
        return dtype
    raise CorruptCheckpointError(f"tensor {key}: dtype {dtype!r} is not a torch dtype",
                                 hint=".metadata is damaged")


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _origin(md: Any, key: str) -> str | None:
    planner = getattr(md, "planner_data", None)
    if isinstance(planner, dict) and key in planner:
        path = planner[key]
        if isinstance(path, (tuple, list)):
            return ".".join(str(p) for p in path)
    return None


def _object_meta(key: str, info: Any) -> ObjectMeta:
    base, shape, offset = key, (), ()
    m = re.fullmatch(r"(.+)/shard_([\d.]+?)(?:_([\d.]+))?", key)
    if m:
        base = m.group(1)
        offset = tuple(int(x) for x in m.group(2).split("."))
        if m.group(3):
            shape = tuple(int(x) for x in m.group(3).split("."))
    return ObjectMeta(
        key=base, unique_key=key,
        file=None if info is None else data_file_name(info.relative_path, key),
        byte_offset=None if info is None else int(info.offset),
        byte_length=None if info is None else int(info.length),
        global_shape=shape, global_offset=offset)
