"""``inspect``: a checkpoint's metadata plus the views people read (splits, totals, tree).

Metadata only: tensor bytes are never read, and for dist checkpoints torch is not imported.
The views (``filter_meta``, ``tensor_tree``, ``object_groups``, ``describe_split``,
``dtype_totals``) are pure functions of a :class:`~ckpt_tool.model.CheckpointMeta`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.planning.model_parts import model_parts
from ckpt_tool.model import CheckpointMeta, TensorMeta
from ckpt_tool.ops.inspect._listing import DEPTH, checkpoints_under

__all__ = ["InspectResult", "inspect", "describe_split", "dtype_totals", "filter_meta",
           "compile_filter", "tensor_tree", "object_groups", "tp_size", "checkpoints_under",
           "DEPTH"]


@dataclass(frozen=True)
class InspectResult:
    """What ``ckpt inspect`` shows: the metadata, how each tensor is split, totals per dtype.

    ``full_common`` is the whole common state (every field, args in full) when asked for.
    ``meta.objects`` are the objects of their own; ``common_items`` the stored items that hold
    the common state instead (``Reader.objects_in_common``: Megatron-Core 0.19's
    ``common_state`` object, a DCP checkpoint's bytes items), shown as the common state."""

    meta: CheckpointMeta
    splits: dict[str, str] = field(default_factory=dict)
    totals: dict[str, dict[str, int]] = field(default_factory=dict)
    full_common: dict[str, Any] | None = None
    common_items: tuple[str, ...] = ()
    #: the architecture parts the stored keys show (planning.model_parts)
    parts: dict[str, str] = field(default_factory=dict)

    def to_dict(self, *, tree: bool = False) -> dict[str, Any]:
        """``CheckpointMeta.to_dict()`` with a ``split`` per tensor, ``dtype_totals`` and
        ``common_items`` (plus ``tree`` when asked for, ``common`` in full when it was
        loaded)."""
        d = self.meta.to_dict()
        for key, entry in d["tensors"].items():
            entry["split"] = self.splits.get(key, "")
        d["dtype_totals"] = self.totals
        d["common_items"] = list(self.common_items)
        d["model_parts"] = dict(self.parts)
        if self.full_common is not None:
            d["common"] = self.full_common
        if tree:
            d["tree"] = tensor_tree(self.meta, self.splits)
        return d


def inspect(path: str | Path, *, trust: bool = False, pattern: str | None = None,
            full_common: bool = False) -> InspectResult:
    """Detect the format of ``path`` and describe the checkpoint without reading tensor data.

    ``pattern`` keeps only tensors/objects whose key matches (``re.search``); ``full_common``
    also loads the whole common state (every field, ``args`` in full; no tensor bytes)."""
    from ckpt_tool.formats import open_checkpoint

    rx = compile_filter(pattern)  # a bad regex fails before any I/O
    full = None
    with open_checkpoint(path, trust=trust) as reader:
        meta = reader.metadata()
        if full_common:
            full = _full_common(reader, meta)
        in_common = reader.objects_in_common()
    parts = model_parts(meta)
    meta = filter_meta(replace(meta, objects=tuple(
        o for o in meta.objects if o.unique_key not in in_common)), rx)
    tp = tp_size(meta)
    return InspectResult(meta=meta,
                         splits={k: describe_split(t, tp=tp) for k, t in meta.tensors.items()},
                         totals=dtype_totals(meta), full_common=full,
                         common_items=tuple(sorted(in_common)), parts=parts)


def tp_size(meta: CheckpointMeta) -> int | None:
    """The tensor-parallel size the checkpoint was saved with (from its common state), if
    known and > 1: lets ``describe_split`` name the TP split."""
    parallel = meta.common.get("parallel") if isinstance(meta.common, dict) else None
    tp = parallel.get("tp") if isinstance(parallel, dict) else None
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else None


def _full_common(reader: Any, meta: CheckpointMeta) -> dict[str, Any]:
    """Every field of the common state, JSON-safe. Uses the reader's torch-free loader
    where it has one (Megatron-Core dist: ``common.pt`` with tensors as placeholders), else the
    summary already in the metadata."""
    state = reader.common_torch_free()
    if state is None:
        return dict(meta.common)
    from ckpt_tool.formats.common_state import jsonable

    out = jsonable(state)
    return out if isinstance(out, dict) else {"value": out}


# -- filtering --------------------------------------------------------------------------------

def compile_filter(pattern: str | re.Pattern[str] | None) -> re.Pattern[str] | None:
    """``pattern`` compiled; a UsageError (exit 2) naming the problem when it is not a regex."""
    if pattern is None or isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"--filter {pattern!r} is not a valid regular expression ({exc})",
                         hint="quote it for the shell; escape literal dots and brackets") from None


def filter_meta(meta: CheckpointMeta, pattern: str | re.Pattern[str] | None) -> CheckpointMeta:
    """Only the tensors whose key and the objects whose unique key match (``re.search``)."""
    rx = compile_filter(pattern)
    if rx is None:
        return meta
    return replace(meta, tensors={k: t for k, t in meta.tensors.items() if rx.search(k)},
                   objects=tuple(o for o in meta.objects
                                 if rx.search(o.unique_key) or rx.search(o.key)))


# -- totals, tree, objects --------------------------------------------------------------------

def dtype_totals(meta: CheckpointMeta) -> dict[str, dict[str, int]]:
    """Per dtype: number of tensors, elements and bytes (logical, i.e. global shapes)."""
    out: dict[str, dict[str, int]] = {}
    for t in meta.tensors.values():
        row = out.setdefault(t.dtype, {"tensors": 0, "numel": 0, "nbytes": 0})
        row["tensors"] += 1
        row["numel"] += t.numel
        row["nbytes"] += t.nbytes
    return dict(sorted(out.items()))


def tensor_tree(meta: CheckpointMeta, splits: dict[str, str] | None = None) -> dict[str, Any]:
    """Tensors grouped by module prefix (dotted path): nested ``{"name", "nbytes", "tensors",
    "children"}``; chains of single-child modules collapse into one node (``decoder.layers``).
    Leaves are the tensors (``"key"``, ``"dtype"``, ``"shape"``, ``"split"`` added)."""
    root: dict[str, Any] = {"name": "", "nbytes": 0, "tensors": 0, "children": {}}
    for key in sorted(meta.tensors):
        t = meta.tensors[key]
        *mods, leaf = key.split(".")
        node = root
        root["nbytes"] += t.nbytes
        root["tensors"] += 1
        for m in mods:
            node = node["children"].setdefault(
                "m:" + m, {"name": m, "nbytes": 0, "tensors": 0, "children": {}})
            node["nbytes"] += t.nbytes
            node["tensors"] += 1
        node["children"]["t:" + leaf] = {
            "name": leaf, "key": key, "dtype": t.dtype, "shape": list(t.shape),
            "split": (splits or {}).get(key) or describe_split(t), "nbytes": t.nbytes,
            "tensors": 1, "children": {}}
    return _finish(root)


def _finish(node: dict[str, Any]) -> dict[str, Any]:
    kids = [_finish(c) for c in node["children"].values()]
    node = {**node, "children": kids}
    # collapse a module whose only child is a module: "decoder" > "layers" -> "decoder.layers"
    while len(node["children"]) == 1 and "key" not in node["children"][0] and node["name"]:
        only = node["children"][0]
        node = {**node, "name": f"{node['name']}.{only['name']}", "children": only["children"]}
    return node


def object_groups(meta: CheckpointMeta) -> list[dict[str, Any]]:
    """Objects summarised per key: ``{"key", "count", "nbytes"}`` (``nbytes`` of the known
    sizes), e.g. one row for the 4 ``rng_state`` shards."""
    out: dict[str, dict[str, Any]] = {}
    for o in meta.objects:
        row = out.setdefault(o.key, {"key": o.key, "count": 0, "nbytes": 0})
        row["count"] += 1
        row["nbytes"] += o.byte_length or 0
    return [out[k] for k in sorted(out)]


# -- how a tensor is split --------------------------------------------------------------------

def _pieces(t: TensorMeta, d: int) -> list[tuple[int, int]] | None:
    """The distinct (offset, size) intervals along dim ``d``, if they tile ``[0, shape[d])``."""
    iv = sorted({(c.offsets[d], c.sizes[d]) for c in t.chunks})
    pos = 0
    for off, size in iv:
        if off != pos or size <= 0:
            return None
        pos += size
    return iv if pos == t.shape[d] else None


def _grid(t: TensorMeta) -> list[list[tuple[int, int]]] | None:
    """Per dim, the pieces of a full grid (every combination stored once), else None."""
    if any(len(c.offsets) != len(t.shape) or len(c.sizes) != len(t.shape) for c in t.chunks):
        return None
    dims = [_pieces(t, d) for d in range(len(t.shape))]
    if any(p is None for p in dims):
        return None
    n = 1
    for p in dims:
        n *= len(p)  # type: ignore[arg-type]
    cells = {tuple(zip(c.offsets, c.sizes)) for c in t.chunks}
    if n != len(t.chunks) or len(cells) != n:
        return None
    return dims  # type: ignore[return-value]


def describe_split(t: TensorMeta, *, tp: int | None = None) -> str:
    """How a tensor is split into stored chunks, as a grid in words after the chunk count:
    ``1 chunk: whole``, ``4 chunks: dim0 ×2 × dim1 ×2``, ``8 chunks: dim0 ×2 × 4 layers``
    (stacked decoder layers: dims then count per layer), ``16 chunks: dim1 ×2 × 4 experts ×
    2 layers``, ``2 chunks: irregular: 3+2 along dim 0`` (uneven pieces, e.g. FSDP2),
    ``4 chunks: flattened (N-D reformulated, block grid 2×2)``.

    With ``tp`` (the checkpoint's TP size), the one dim split evenly into exactly ``tp``
    pieces is named: ``8 chunks: tp 0-1 along dim 0 × 4 layers``."""
    n = len(t.chunks)
    if n == 0:
        return "no chunks stored"
    return f"{n} chunk" + ("" if n == 1 else "s") + ": " + _grid_words(t, tp)


def _grid_words(t: TensorMeta, tp: int | None = None) -> str:
    n = len(t.chunks)
    if t.stored_shape is not None:
        grid = "×".join(str(s) for s in t.stored_shape[:-1]) or "1"
        return f"flattened (N-D reformulated, block grid {grid})"
    shape = t.shape
    if not shape:
        return "scalar" if n == 1 else f"scalar ×{n} (replicas)"
    whole = [c for c in t.chunks if tuple(c.offsets) == (0,) * len(shape)
             and tuple(c.sizes) == tuple(shape)]
    if whole:
        if n == 1:
            return "whole"
        return f"whole ×{n} (replicas)" if len(whole) == n else f"irregular ({len(whole)} whole)"
    dims = _grid(t)
    if dims is None:
        stored = sum(c.numel for c in t.chunks)
        return "irregular" + ("" if stored == t.numel
                              else f", cover {stored}/{t.numel} elements")
    first = 0
    tail: list[str] = []
    if ".layers." in t.key and len(shape) > 1 and len(dims[0]) == shape[0] > 1 \
            and not _numbered_layer(t.key):
        tail.append(f"{shape[0]} layers")
        first = 1
        if "expert" in t.key and len(shape) > 2 and len(dims[1]) == shape[1] > 1:
            tail.insert(0, f"{shape[1]} experts")
            first = 2
    parts: list[str] = []
    uneven = False
    tp_dims = [d for d in range(first, len(shape)) if tp and len(dims[d]) == tp
               and len({s for _, s in dims[d]}) == 1]
    for d in range(first, len(shape)):
        pieces = dims[d]
        if len(pieces) == 1:
            continue
        sizes = [s for _, s in pieces]
        if tp_dims == [d]:  # exactly one dim split into tp even pieces: the TP split
            parts.append(f"tp 0-{tp - 1} along dim {d - first}")
        elif len(set(sizes)) == 1:
            parts.append(f"dim{d - first} ×{len(pieces)}")
        else:
            uneven = True
            parts.append("+".join(map(str, sizes)) + f" along dim {d - first}")
    text = " × ".join(parts + tail) or "whole"
    return ("irregular: " + text) if uneven else text


def _numbered_layer(key: str) -> bool:
    """Heterogeneous models use per-layer keys ``decoder.layers.{i}.…`` (no stacked axis)."""
    after = key.split(".layers.", 1)[1]
    return after.split(".", 1)[0].isdigit()
