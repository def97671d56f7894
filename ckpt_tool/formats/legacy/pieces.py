"""Rank-local tensor pieces of a Megatron-LM legacy checkpoint and how they merge into one
global tensor (no torch import).

A :class:`Piece` is one rank's copy of a model or optimizer tensor: its file, dtype, local
shape, raw byte range when known, and the path that finds it again in the loaded file.
:func:`merge_pieces` applies the TP split rule of ``legacy.layout.split_rule`` and checks
that every copy (TP ranks of a replicated parameter, EP ranks of a dense one) agrees on dtype
and shape.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, NamedTuple

from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.legacy.optim import is_expert_param
from ckpt_tool.model import ChunkRef, TensorMeta, dtype_itemsize

__all__ = ["Piece", "walk", "describe", "make_piece", "merge_pieces"]

# chunk -> (piece, (row start, row stop) of the local tensor or None)
Sources = dict[ChunkRef, tuple["Piece", "tuple[int, int] | None"]]


class Piece(NamedTuple):
    """One rank's copy of a (model or optimizer) tensor: where it lies and how to load it."""

    tp: int
    rel: str                      # rank file, relative to the checkpoint root
    dtype: str
    shape: tuple[int, ...]
    chunk: ChunkRef | None        # raw byte range of the (viewed) local tensor, when known
    path: tuple[Any, ...]         # walk from the loaded file to the tensor
    flat: int | None              # start inside a coalesced 1-D tensor (distrib_optim.pt)


def walk(obj: Any, path: tuple[Any, ...]) -> Any:
    """Follow ``path`` into a loaded object; an ``("#", i)`` step takes the i-th dict value."""
    for step in path:
        if isinstance(step, tuple) and step and step[0] == "#":
            obj = list(obj.values())[step[1]]
        else:
            obj = obj[step]
    return obj


def describe(v: Any) -> tuple[str, tuple[int, ...]] | None:
    """``(dtype, shape)`` of a tensor placeholder or real tensor; None for anything else."""
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import TensorPlaceholder

    if isinstance(v, TensorPlaceholder):
        return str(v.dtype), tuple(int(s) for s in v.shape)
    if type(v).__module__.startswith("torch") and hasattr(v, "dtype") and hasattr(v, "shape") \
            and hasattr(v, "storage_offset"):
        return str(v.dtype).replace("torch.", ""), tuple(int(s) for s in v.shape)
    return None


def make_piece(root: Path, tp: int, rel: str, t: Any, path: tuple[Any, ...], storages: Any,
               flat: int | None = None, shape: tuple[int, ...] | None = None) -> Piece:
    """A piece for tensor ``t`` (a placeholder, or a real tensor after a torch fallback) of
    rank file ``rel`` (``storages`` = its ``torch_save_files.zip_storages``); with ``flat``/``shape``:
    a ``shape`` view starting at element ``flat`` of the 1-D ``t``."""
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import TensorPlaceholder
    from ckpt_tool.formats.containers.torch_zip.torch_save_files import placeholder_chunk

    dtype, tshape = describe(t)  # type: ignore[misc]
    chunk = None
    if isinstance(t, TensorPlaceholder):
        _, stor, byteorder = storages
        # torch_save's byte-range rule for one placeholder (its ``self`` needs only .path)
        chunk = placeholder_chunk(root / rel, ".".join(map(str, path)), t, tshape, stor,
                                  byteorder)
    if flat is not None:
        assert shape is not None
        n, size = math.prod(shape), dtype_itemsize(dtype)
        if chunk is not None:
            chunk = dataclasses.replace(chunk, sizes=shape, offsets=(0,) * len(shape),
                                        byte_offset=chunk.byte_offset + flat * size,
                                        byte_length=n * size)
        tshape = shape
    if chunk is not None:
        chunk = dataclasses.replace(chunk, file=rel)
    return Piece(tp, rel, dtype, tshape, chunk, path, flat)


def merge_pieces(gk: str, parts: list[Piece], tp_size: int, swiglu: bool, etp: int | None
                 ) -> tuple[TensorMeta | None, Sources, list[dict[str, Any]]]:
    """``(global TensorMeta or None when it cannot be merged, chunk sources, problems)``.

    Routed experts follow ``expert_tensor_parallel_size`` (``etp``): 1 = not split."""
    kind, dim = L.split_rule(gk, swiglu=swiglu)
    if is_expert_param(gk) and tp_size > 1 and etp is not None and int(etp) != tp_size:
        if int(etp) != 1:
            return None, {}, []
        kind, dim = L.REPLICATED, None
    by_tp: dict[int, Piece] = {}
    for p in parts:
        by_tp.setdefault(p.tp, p)
    p0 = by_tp[min(by_tp)]
    dtype, lshape = p0.dtype, p0.shape
    problems = [{"message": f"TP rank {p.tp} holds {p.dtype}{list(p.shape)}, TP rank "
                 f"{p0.tp} {dtype}{list(lshape)}", "key": gk, "file": p.rel}
                for p in parts if p.dtype != dtype or p.shape != lshape]
    sources: Sources = {}

    def base(p: Piece) -> ChunkRef:
        return p.chunk or ChunkRef(offsets=(0,) * len(p.shape), sizes=p.shape, file=p.rel,
                                   layout="torch_save")

    if kind == L.REPLICATED or tp_size == 1 or not lshape:
        if kind != L.REPLICATED and tp_size > 1 and not lshape:
            return None, {}, problems
        c = base(p0)
        sources[c] = (p0, None)
        return TensorMeta(key=gk, dtype=dtype, shape=lshape, chunks=(c,), origin=kind), \
            sources, problems
    gshape = list(lshape)
    gshape[dim] *= tp_size
    chunks = []
    for tp, p in sorted(by_tp.items()):
        if p.shape != lshape:
            continue
        c = base(p)
        if kind == L.GLU:
            half = lshape[0] // 2
            row_bytes = dtype_itemsize(dtype) * (c.numel // max(lshape[0], 1))
            for i, start in enumerate((tp * half, tp_size * half + tp * half)):
                cc = dataclasses.replace(
                    c, offsets=(start,) + (0,) * (len(lshape) - 1), sizes=(half, *lshape[1:]),
                    byte_offset=None if c.byte_offset is None
                    else c.byte_offset + i * half * row_bytes,
                    byte_length=None if c.byte_length is None else half * row_bytes)
                sources[cc] = (p, (i * half, (i + 1) * half))
                chunks.append(cc)
        else:
            off = [0] * len(lshape)
            off[dim] = tp * lshape[dim]
            cc = dataclasses.replace(c, offsets=tuple(off))
            sources[cc] = (p, None)
            chunks.append(cc)
    return TensorMeta(key=gk, dtype=dtype, shape=tuple(gshape), chunks=tuple(chunks),
                      origin=kind), sources, problems
