"""MCore's zarr backend on disk: one zarr v2 array directory per tensor, read without zarr.

Metadata comes from each ``.zarray`` JSON and the chunk files present (``0.0``, ``1.0`` ...);
chunk bytes are never read for metadata. Uncompressed chunks (what MCore writes) are read
directly; compressed ones go through tensorstore.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError
from ckpt_tool.model import ChunkRef, ObjectMeta, TensorMeta

__all__ = ["zarr_dtype_name", "scan_zarr_dir", "read_zarr_array_meta", "load_zarr_chunk"]

_NUMPY_TYPES = {
    "f8": "float64", "f4": "float32", "f2": "float16", "i8": "int64", "i4": "int32",
    "i2": "int16", "i1": "int8", "u1": "uint8", "u2": "uint16", "u4": "uint32", "u8": "uint64",
    "b1": "bool", "c8": "complex64", "c16": "complex128",
}
_SHARD_RE = re.compile(r"shard_([\d.]+?)(?:_([\d.]+))?\.pt")
_CHUNK_RE = re.compile(r"\d+(?:\.\d+)*")  # a zarr v2 chunk file name ("0", "1.0", "0.0.3")


def zarr_dtype_name(dtype: Any) -> str:
    """A ``.zarray`` dtype (``"<f4"``, ``"bfloat16"``, ``"|b1"``) -> torch dtype name."""
    if not isinstance(dtype, str):
        raise ValueError(f"unsupported structured dtype {dtype!r}")
    if dtype in ("bfloat16", "<bfloat16") or dtype.startswith("float8") or dtype.startswith("<V"):
        return dtype.lstrip("<")
    code = dtype.lstrip("<>|=")
    if dtype.startswith(">") and code[1:] not in ("1",):
        raise ValueError(f"big-endian dtype {dtype!r} is not supported")
    try:
        return _NUMPY_TYPES[code]
    except KeyError:
        raise ValueError(f"unsupported zarr dtype {dtype!r}") from None


def read_zarr_array_meta(array_dir: Path, root: Path) -> TensorMeta:
    """TensorMeta of one zarr array directory (chunks = the chunk files present)."""
    zpath = array_dir / ".zarray"
    try:
        za = json.loads(zpath.read_text(encoding="utf-8"))
        shape = tuple(int(s) for s in za["shape"])
        chunk_shape = tuple(int(c) for c in za["chunks"])
        dtype = zarr_dtype_name(za["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"unreadable .zarray ({type(exc).__name__}: {exc})",
                                     path=zpath) from None
    if len(chunk_shape) != len(shape) or any(c <= 0 for c in chunk_shape):
        raise CorruptCheckpointError(f".zarray chunks {list(chunk_shape)} do not fit shape "
                                     f"{list(shape)}", path=zpath)
    sep = za.get("dimension_separator") or "."
    compressor = za.get("compressor")
    transforms = () if compressor is None else (f"zarr.{compressor.get('id', '?')}",)
    filters = za.get("filters") or []
    transforms += tuple(f"zarr.{f.get('id', '?')}" for f in filters)
    rel = array_dir.relative_to(root).as_posix()
    chunks = []
    grid = [math.ceil(s / c) if s else 0 for s, c in zip(shape, chunk_shape)]
    for idx in _grid_indices(grid):
        name = sep.join(str(i) for i in idx) if idx else "0"
        f = array_dir / name
        if not f.is_file():
            continue
        offsets = tuple(i * c for i, c in zip(idx, chunk_shape))
        sizes = tuple(min(c, s - o) for c, s, o in zip(chunk_shape, shape, offsets))
        # zarr v2 stores edge chunks padded to the full chunk shape: not raw C-order of sizes
        layout = "raw" if sizes == tuple(chunk_shape) else "zarr_edge"
        chunks.append(ChunkRef(offsets=offsets, sizes=sizes, file=f"{rel}/{name}",
                               byte_offset=0, byte_length=f.stat().st_size,
                               transforms=transforms, layout=layout))
    return TensorMeta(key=rel, dtype=dtype, shape=shape, chunks=tuple(chunks),
                      origin=f"zarr:{za.get('order', 'C')}")


def _grid_indices(grid: list[int]) -> list[tuple[int, ...]]:
    if not grid:
        return [()]
    if math.prod(grid) > 1_000_000:
        raise CorruptCheckpointError(f"chunk grid {grid} is implausibly large")
    out: list[tuple[int, ...]] = [()]
    for n in grid:
        out = [t + (i,) for t in out for i in range(n)]
    return out


def scan_zarr_dir(root: Path) -> tuple[dict[str, TensorMeta], list[ObjectMeta]]:
    """Every array (a dir with ``.zarray``) and ShardedObject (``shard_*.pt``) under ``root``."""
    tensors: dict[str, TensorMeta] = {}
    objects: list[ObjectMeta] = []
    stack = [root]
    while stack:
        d = stack.pop()
        for child in sorted(d.iterdir()):
            # ``*.sync``: flattened-tensor synchronizers; a nested ``metadata.json`` marks a
            # separate checkpoint (``modelopt_state/``).
            if not child.is_dir() or child.name.endswith(".sync") \
                    or (child / "metadata.json").is_file():
                continue
            if (child / ".zarray").is_file():
                tm = read_zarr_array_meta(child, root)
                tensors[tm.key] = tm
                continue
            shards = sorted(p for p in child.iterdir() if _SHARD_RE.fullmatch(p.name))
            key = child.relative_to(root).as_posix()
            if not shards and any(_CHUNK_RE.fullmatch(p.name) and p.is_file()
                                  for p in child.iterdir()):
                # Megatron-Core lists only directories with a .zarray, then fails to open
                # this array when a state dict asks for it: the checkpoint does not load
                raise CorruptCheckpointError(
                    f"zarr array {key!r} has chunk files but no .zarray: Megatron-Core "
                    "cannot load it; restore .zarray from the writer's copy or re-save",
                    path=child / ".zarray")
            for p in shards:
                m = _SHARD_RE.fullmatch(p.name)
                assert m is not None
                objects.append(ObjectMeta(
                    key=key, unique_key=f"{key}/{p.name[:-3]}", file=f"{key}/{p.name}",
                    byte_offset=0, byte_length=p.stat().st_size,
                    global_offset=tuple(int(x) for x in m.group(1).split(".")),
                    global_shape=tuple(int(x) for x in m.group(2).split(".")) if m.group(2)
                    else ()))
            stack.append(child)
    objects.sort(key=lambda o: o.unique_key)
    return tensors, objects


def load_zarr_chunk(root: Path, meta: TensorMeta, chunk: ChunkRef, chunk_shape: tuple[int, ...]
                    ) -> Any:
    """One chunk as a torch.Tensor of ``chunk.sizes`` (edge chunks are stored padded)."""
    import torch

    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

    dtype = torch_dtype(meta.dtype)
    if chunk.transforms:
        return _load_with_tensorstore(root, meta, chunk)
    path = root / str(chunk.file)
    data = path.read_bytes()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(data) != math.prod(chunk_shape) * itemsize:
        raise CorruptCheckpointError(
            f"chunk file has {len(data)} bytes, expected {math.prod(chunk_shape) * itemsize}",
            path=path)
    t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(chunk_shape) if data else \
        torch.empty(chunk_shape, dtype=dtype)
    return t[tuple(slice(0, s) for s in chunk.sizes)]


def _load_with_tensorstore(root: Path, meta: TensorMeta, chunk: ChunkRef) -> Any:
    import tensorstore as ts
    import torch

    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

    array_dir = root / meta.key
    arr = ts.open({"driver": "zarr", "metadata_key": ".zarray",
                   "kvstore": {"driver": "file", "path": str(array_dir)}}, open=True).result()
    region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
    np_data = arr[region].read().result()
    dtype = torch_dtype(meta.dtype)
    if meta.dtype == "bfloat16":
        return torch.from_numpy(np_data.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(np_data).to(dtype)
