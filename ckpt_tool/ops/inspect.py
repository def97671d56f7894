"""``inspect``: a checkpoint's metadata plus the views people read (splits, totals).

Metadata only: tensor bytes are never read, and for dist checkpoints torch is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_tool.model import CheckpointMeta, TensorMeta

__all__ = ["InspectResult", "inspect", "describe_split", "dtype_totals"]


@dataclass(frozen=True)
class InspectResult:
    """What ``ckpt inspect`` shows: the metadata, how each tensor is split, totals per dtype."""

    meta: CheckpointMeta
    splits: dict[str, str] = field(default_factory=dict)
    totals: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """``CheckpointMeta.to_dict()`` with a ``split`` per tensor and ``dtype_totals``."""
        d = self.meta.to_dict()
        for key, entry in d["tensors"].items():
            entry["split"] = self.splits.get(key, "")
        d["dtype_totals"] = self.totals
        return d


def inspect(path: str | Path, *, trust: bool = False) -> InspectResult:
    """Detect the format of ``path`` and describe the checkpoint without reading tensor data."""
    from ckpt_tool.formats import open_checkpoint

    with open_checkpoint(path, trust=trust) as reader:
        meta = reader.metadata()
    return InspectResult(meta=meta, splits={k: describe_split(t) for k, t in meta.tensors.items()},
                         totals=dtype_totals(meta))


def dtype_totals(meta: CheckpointMeta) -> dict[str, dict[str, int]]:
    """Per dtype: number of tensors, elements and bytes (logical, i.e. global shapes)."""
    out: dict[str, dict[str, int]] = {}
    for t in meta.tensors.values():
        row = out.setdefault(t.dtype, {"tensors": 0, "numel": 0, "nbytes": 0})
        row["tensors"] += 1
        row["numel"] += t.numel
        row["nbytes"] += t.nbytes
    return dict(sorted(out.items()))


def _fragments(t: TensorMeta, shape: tuple[int, ...]) -> list[int]:
    return [len({c.offsets[d] for c in t.chunks}) for d in range(len(shape))]


def _regular(t: TensorMeta, shape: tuple[int, ...], frags: list[int]) -> bool:
    """Chunks form a full grid of equal pieces (``shape // frags`` each)."""
    if len(t.chunks) != _prod(frags):
        return False
    for d, n in enumerate(frags):
        if shape[d] % n or any(c.sizes[d] != shape[d] // n for c in t.chunks):
            return False
    return True


def _prod(xs: list[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def describe_split(t: TensorMeta) -> str:
    """How a tensor is split into stored chunks, e.g. ``4 chunks: dim0 ×2, dim1 ×2`` or
    ``8 chunks: layers ×4 × dim0 ×2`` (stacked decoder layers; dims then count per layer)."""
    n = len(t.chunks)
    head = f"{n} chunk" + ("" if n == 1 else "s")
    if n == 0:
        return "no chunks stored"
    if t.stored_shape is not None:
        grid = "×".join(str(s) for s in t.stored_shape[:-1]) or "1"
        return f"{head}: flattened (N-D reformulated, block grid {grid})"
    shape = t.shape
    if not shape:
        return head + ": scalar"
    stored_numel = sum(c.numel for c in t.chunks)
    if n == 1 and tuple(t.chunks[0].sizes) == tuple(shape):
        return head + ": whole"
    frags = _fragments(t, shape)
    if not _regular(t, shape, frags):
        cover = "" if stored_numel == t.numel else f", cover {stored_numel}/{t.numel} elements"
        return f"{head}: irregular" + cover
    parts: list[str] = []
    first = 0
    if ".layers." in t.key and len(shape) > 1 and frags[0] == shape[0] and frags[0] > 1 \
            and not _numbered_layer(t.key):
        parts.append(f"layers ×{frags[0]}")
        first = 1
        if "expert" in t.key and len(shape) > 2 and frags[1] == shape[1] and frags[1] > 1:
            parts.append(f"experts ×{frags[1]}")
            first = 2
    dims = [f"dim{d - first} ×{frags[d]}" for d in range(first, len(shape)) if frags[d] > 1]
    if first:
        return head + ": " + " × ".join(parts + dims)
    return head + ": " + ", ".join(dims)


def _numbered_layer(key: str) -> bool:
    """Heterogeneous models use per-layer keys ``decoder.layers.{i}.…`` (no stacked axis)."""
    after = key.split(".layers.", 1)[1]
    return after.split(".", 1)[0].isdigit()
