"""Writer for the Megatron-Core ``zarr`` dist checkpoint layout (docs/formats.md section 2).

Output, as Megatron-Core <= 0.15 wrote it::

    <dir>/<key>/.zarray            zarr v2, uncompressed, "dtype": "bfloat16" for bf16
    <dir>/<key>/0.0, 1.0, ...      one raw C-order little-endian file per chunk
    <dir>/<key>/shard_<offsets>_<shape>.pt   ShardedObjects (torch.save of the payload)
    <dir>/common.pt                torch.save of the full common state
    <dir>/metadata.json            written last: {"sharded_backend": "zarr", ...}

Array headers are created by :func:`ckpt_tool.formats.mcore_dist.zarr_store.create_array`
(the byte-identical reimplementation of Megatron-Core's writer); chunk files are then written
here directly, one at a time: the chunk is pulled slab by slab (:func:`slab_pieces` of the
chunk shape, each slab contiguous in the chunk file) so even a chunk larger than
``max_memory`` is never held whole. Edge chunks are zero-padded to the full chunk shape, as
zarr-python does with ``fill_value: null``.

Chunk grid: the target grid from ``meta.tensors[key].chunks`` when it is regular (every chunk
the size of the chunk at the origin, clipped at the far edges); otherwise a regular grid of
slabs that fit ``max_memory`` (a note says so when a grid was asked for). ``common.pt`` holds
``request.common`` as is; objects whose unique key is not a ShardedObject key
(``<key>/shard_<offsets>_<shape>``) cannot be addressed by the layout and are dropped with a
note. Tensor keys must be safe relative paths (no ``..``, no leading ``/``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UnsupportedError, plural
from ckpt_tool.formats.write_guard import torch_save_file
from ckpt_tool.formats.write_pieces import (DEFAULT_MAX_MEMORY, my_share, pull_piece,
                                         run_share, slab_pieces, tensor_bytes)
from ckpt_tool.formats.writer import WriteRequest, Writer
from ckpt_tool.model import TensorMeta, dtype_itemsize

__all__ = ["ZarrWriter", "regular_chunk_shape", "budget_chunk_shape", "save_torch_checked"]

METADATA = {"sharded_backend": "zarr", "sharded_backend_version": 1,
            "common_backend": "torch", "common_backend_version": 1}
_SHARD_KEY = re.compile(r".+/shard_\d+(\.\d+)*(_\d+(\.\d+)*)?")


def _safe_relpath(key: str) -> bool:
    """Whether ``key`` names a path strictly inside the output directory."""
    parts = key.split("/")
    return bool(key) and not key.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def save_torch_checked(obj: Any, path: Path, what: str) -> None:
    """``torch_save_file(obj, path)`` (stand-ins of classes read without importing them are
    written as what they stand for); UnsupportedError, naming ``what``, for anything else
    ``torch.save`` cannot pickle."""
    try:
        torch_save_file(obj, path)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise UnsupportedError(f"{what} cannot be saved with torch.save ({exc})") from None


def regular_chunk_shape(meta: TensorMeta) -> tuple[int, ...] | None:
    """The chunk shape of ``meta.chunks`` if they form a regular grid covering the tensor."""
    if not meta.chunks:
        return None
    origin = [c for c in meta.chunks if all(o == 0 for o in c.offsets)]
    if len(origin) != 1:
        return None
    shape = tuple(meta.shape)
    chunk = tuple(origin[0].sizes)
    if len(chunk) != len(shape) or any(c <= 0 for c, s in zip(chunk, shape) if s > 0):
        return None
    seen = set()
    for c in meta.chunks:
        idx = tuple(o // k if k else 0 for o, k in zip(c.offsets, chunk))
        expect = tuple(min(k, s - o) for k, s, o in zip(chunk, shape, c.offsets))
        if any(o % k for o, k in zip(c.offsets, chunk) if k) or tuple(c.sizes) != expect:
            return None
        seen.add(idx)
    grid = math.prod(-(-s // k) if k else 1 for s, k in zip(shape, chunk))
    return chunk if len(seen) == grid == len(meta.chunks) else None


def budget_chunk_shape(shape: tuple[int, ...], itemsize: int, budget: int) -> tuple[int, ...]:
    """A regular chunk shape of at most ``budget`` bytes: the first slab of ``slab_pieces``."""
    return next(slab_pieces(tuple(shape), itemsize, budget))[1]


class ZarrWriter(Writer):
    """Megatron-Core zarr layout writer; see the module docstring. Under torchrun every rank
    writes whole arrays (split by bytes); rank 0 also writes the objects and ``common.pt``
    and, once every rank is done, ``metadata.json``."""

    format_name = "zarr"
    supports_ranks = True
    chunked = keeps_source_grid = True

    def write(self, request: WriteRequest) -> list[str]:
        """Write arrays, ShardedObjects, ``common.pt`` and (last) ``metadata.json``."""
        import torch

        from ckpt_tool.errors import CheckpointingException
        from ckpt_tool.formats.mcore_dist import zarr_store as zio

        notes: list[str] = []
        budget = self.options.max_memory or DEFAULT_MAX_MEMORY
        tensors = list(request.meta.tensors.values())
        for t in tensors:
            if not _safe_relpath(t.key):
                raise UnsupportedError(f"tensor key {t.key!r} is not a safe relative path: the "
                                       "zarr layout stores each tensor in a directory named "
                                       "after its key")
            dt = getattr(torch, t.dtype, None)
            try:
                zio.numpy_dtype_for(dt)
            except CheckpointingException:
                raise UnsupportedError(f"tensor {t.key!r}: dtype {t.dtype} cannot be stored by "
                                       "the zarr backend", hint="cast it") from None
        grids, regridded = [], []
        for t in tensors:
            chunk = regular_chunk_shape(t)
            if chunk is None:
                chunk = budget_chunk_shape(t.shape, dtype_itemsize(t.dtype), budget)
                if t.chunks:  # the planner asked for a grid zarr cannot express
                    regridded.append(t.key)
            grids.append(chunk)
        if regridded:
            shown = ", ".join(regridded[:5]) + (", ..." if len(regridded) > 5 else "")
            notes.append(f"{plural(len(regridded), 'tensor')} had no regular chunk grid ({shown}): "
                         f"stored with regular chunks of at most {budget} bytes")
        objects, dropped = [], []
        for o in request.meta.objects:
            ok = _SHARD_KEY.fullmatch(o.unique_key) and _safe_relpath(o.unique_key)
            (objects if ok else dropped).append(o)
        if dropped:
            shown = ", ".join(o.unique_key for o in dropped[:5]) + (", ..." if len(dropped) > 5
                                                                    else "")
            notes.append(f"dropped {plural(len(dropped), 'object')} ({shown}): not ShardedObject "
                         "keys (<key>/shard_<offsets>_<shape>), which the zarr layout cannot address")
        for name in [t.key for t in tensors] + [o.unique_key for o in objects]:
            _check_entry_name(name)
        ranks = request.ranks
        main = ranks is None or ranks.is_main
        mine = my_share(ranks, [t.nbytes for t in tensors])

        def work() -> None:
            for i in mine:
                t = tensors[i]
                zio.create_array(self.directory / t.key, t.shape, getattr(torch, t.dtype),
                                 grids[i])
                self._write_chunks(t, grids[i], request, budget)
            if main:
                for o in objects:
                    path = self.directory / f"{o.unique_key}.pt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    save_torch_checked(request.objects(o.unique_key), path,
                                       f"object {o.unique_key!r}")
                save_torch_checked(request.common, self.directory / "common.pt",
                                   "the common state")

        run_share(ranks, work)
        if main:  # last: it marks the checkpoint complete
            (self.directory / "metadata.json").write_text(json.dumps(METADATA), encoding="utf-8")
        return notes

    def _write_chunks(self, t: TensorMeta, chunk: tuple[int, ...], request: WriteRequest,
                      budget: int) -> None:
        import torch

        shape = tuple(t.shape)
        if math.prod(shape) == 0:
            return
        itemsize = dtype_itemsize(t.dtype)
        grid = [-(-s // k) for s, k in zip(shape, chunk)]
        array_dir = self.directory / t.key
        for idx in itertools.product(*(range(n) for n in grid)):
            origin = tuple(i * k for i, k in zip(idx, chunk))
            name = ".".join(map(str, idx)) if idx else "0"
            with open(array_dir / name, "wb") as f:
                for rel, sizes in slab_pieces(chunk, itemsize, budget):
                    start = tuple(o + r for o, r in zip(origin, rel))
                    inside = tuple(max(0, min(n, s - a)) for n, s, a in zip(sizes, shape, start))
                    if inside == tuple(sizes):
                        piece = pull_piece(request, t, start, sizes)
                    else:  # beyond the array edge: zero padding, as zarr-python writes it
                        piece = torch.zeros(sizes, dtype=getattr(torch, t.dtype))
                        if math.prod(inside):
                            piece[tuple(slice(0, n) for n in inside)] = \
                                pull_piece(request, t, start, inside)
                    data = tensor_bytes(piece)
                    f.write(data)
                    del piece
                    request.progress(math.prod(inside) * itemsize)


def _check_entry_name(name: str) -> None:
    """UsageError when ``name`` (a tensor's array directory, an object's file) cannot be a
    path inside the checkpoint: a NUL byte, an empty or ``.``/``..`` part, a part longer
    than a file name may be."""
    parts = name.split("/")
    if "\0" in name or any(p in ("", ".", "..") or len(os.fsencode(p)) > 250 for p in parts):
        from ckpt_tool.errors import UsageError

        raise UsageError(f"the key {name!r} cannot name a file of a zarr checkpoint (one "
                         "directory or file per key)",
                         hint="rename it (--rename) or convert to another format")
