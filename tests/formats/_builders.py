"""Test-only builders of small checkpoints on disk (real torch DCP classes, hand-placed chunks).

``write_dcp`` writes ``.metadata`` + ``.distcp`` exactly the way DCP's FileSystemWriter lays
them out (each item an independent torch.save archive at a recorded byte range), but with the
chunking chosen by the test. ``write_mcore_dist`` adds ``metadata.json`` and ``common.pt``.
``write_zarr`` writes an MCore zarr-backend checkpoint (zarr v2 arrays, raw chunks).
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

MCORE_TORCH = "megatron.core.dist_checkpointing.strategies.torch"


def write_dcp(root: Path, tensors: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], torch.Tensor]]]],
              objects: dict[str, Any] | None = None, *, files: int = 2,
              mcore_data: dict | None = None, metadata_cls: type = Metadata) -> Metadata:
    """``tensors[key] = (global_shape, [(offsets, chunk), ...])``; ``objects[unique_key] = data``
    (stored as ``torch.save([data])`` like MCore's ShardedObjects)."""
    root.mkdir(parents=True, exist_ok=True)
    streams = [io.BytesIO() for _ in range(files)]
    sd_md: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    n = 0
    for ukey, data in (objects or {}).items():
        buf = io.BytesIO()
        torch.save([data], buf)
        s = streams[n % files]
        storage[MetadataIndex(ukey)] = _StorageInfo(f"__0_{n % files}.distcp", s.tell(),
                                                    len(buf.getvalue()))
        s.write(buf.getvalue())
        sd_md[ukey] = BytesStorageMetadata()
        n += 1
    for key, (shape, chunks) in tensors.items():
        metas = []
        for offsets, t in chunks:
            buf = io.BytesIO()
            torch.save(t.contiguous(), buf)
            s = streams[n % files]
            storage[MetadataIndex(key, offsets)] = _StorageInfo(
                f"__0_{n % files}.distcp", s.tell(), len(buf.getvalue()))
            s.write(buf.getvalue())
            metas.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(t.shape)))
            n += 1
        dtype = chunks[0][1].dtype
        sd_md[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), metas)
    for i, s in enumerate(streams):
        (root / f"__0_{i}.distcp").write_bytes(s.getvalue())
    md = metadata_cls(state_dict_metadata=sd_md, planner_data={}, storage_data=storage,
                      version="1.0.0")
    if mcore_data is not None:
        md.mcore_data = mcore_data
    (root / ".metadata").write_bytes(pickle.dumps(md))
    return md


def split_grid(t: torch.Tensor, frags: tuple[int, ...]) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Cut ``t`` into an even grid of ``frags`` pieces per dimension."""
    out = [((), t)]
    for dim, n in enumerate(frags):
        size = t.shape[dim] // n
        out = [(off + (i * size,), piece.narrow(dim, i * size, size))
               for off, piece in out for i in range(n)]
    return out


def write_common(path: Path, state: dict) -> None:
    torch.save(state, path)


def write_mcore_dist(root: Path, tensors: dict, objects: dict | None = None, *,
                     common: dict | None = None, **kw: Any) -> Path:
    """A torch_dist MCore-style checkpoint (metadata.json, common.pt, DCP files)."""
    write_dcp(root, tensors, objects, **kw)
    if common is not None:
        write_common(root / "common.pt", common)
    (root / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    return root


@contextlib.contextmanager
def fake_module(name: str, **attrs: Any):
    """Temporarily importable module ``name`` (and parents) so pickles can reference it."""
    parts = name.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        mod_name = ".".join(parts[:i])
        if mod_name not in sys.modules:
            sys.modules[mod_name] = types.ModuleType(mod_name)
            added.append(mod_name)
    module = sys.modules[name]
    missing = object()
    previous = {k: getattr(module, k, missing) for k in attrs}
    for k, v in attrs.items():
        v.__module__ = name
        v.__qualname__ = k
        setattr(module, k, v)
    try:
        yield module
    finally:
        for k, v in previous.items():  # the real module may be imported by another test
            if v is missing:
                delattr(module, k)
            else:
                setattr(module, k, v)
        for mod_name in added:
            del sys.modules[mod_name]


def write_zarr(root: Path, tensors: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
               objects: dict[str, Any] | None = None, *, common: dict | None = None,
               skip_chunks: set[tuple[str, str]] = frozenset()) -> Path:
    """An MCore zarr-backend checkpoint: ``tensors[key] = (tensor, chunk_shape)``;
    ``objects["rng_state/shard_0.1_1.2"] = data`` -> ``rng_state/shard_0.1_1.2.pt``."""
    root.mkdir(parents=True, exist_ok=True)
    names = {torch.float32: "<f4", torch.float16: "<f2", torch.bfloat16: "bfloat16",
             torch.int64: "<i8", torch.uint8: "|u1"}
    for key, (t, chunk_shape) in tensors.items():
        d = root / key
        d.mkdir()
        (d / ".zarray").write_text(json.dumps({
            "zarr_format": 2, "shape": list(t.shape), "chunks": list(chunk_shape),
            "dtype": names[t.dtype], "compressor": None, "fill_value": None, "order": "C",
            "filters": None}))
        for off, piece in split_grid(t, tuple(s // c for s, c in zip(t.shape, chunk_shape))):
            name = ".".join(str(o // c) for o, c in zip(off, chunk_shape)) or "0"
            if (key, name) in skip_chunks:
                continue
            raw = piece.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else piece
            (d / name).write_bytes(raw.contiguous().numpy().tobytes())
    for ukey, data in (objects or {}).items():
        p = root / f"{ukey}.pt"
        p.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, p)
    if common is not None:
        write_common(root / "common.pt", common)
    (root / "metadata.json").write_text(json.dumps({
        "sharded_backend": "zarr", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}))
    return root
