"""The element-wise path and the common-state comparison of ``diff`` (imports torch lazily).

:func:`compare_values` reads the pieces of one tensor that the byte path did not prove equal:
the cells of the union of both chunk grids (so each read touches one chunk per side), cut into
slabs of at most ``PIECE_BYTES`` along the outer dimensions when a side is unchunked, and
compares them in blocks of ``_ELEMS`` elements in a wide dtype: equal when
``|a - b| <= atol + rtol * |b|``, or both NaN at the same position. It returns a
:class:`TensorDiff` with the count, max abs/rel diff and the first differing index (C order).

:func:`compare_common` flattens both common states (dicts and ``argparse.Namespace`` by field)
and lists every field that changed, exists on one side only, or cannot be compared.
:func:`compare_objects` does the same for the payloads of the stored objects both sides hold
(ShardedObjects: RNG states, extra state), read through each reader's safe unpickler unless
their stored bytes are identical.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ckpt_tool.formats.containers.torch_zip.archive_check import check_archive, check_file
from ckpt_tool.model import CheckpointMeta, TensorMeta, dtype_itemsize
from ckpt_tool.ops.diff._bytes import Box
from ckpt_tool.ops.diff._windows import memcmp

__all__ = ["TensorDiff", "CommonDiff", "compare_values", "compare_common", "compare_objects",
           "same_common_file", "js", "PIECE_BYTES"]

PIECE_BYTES = 64 << 20  # largest piece read per side
_ELEMS = 1 << 22  # elements compared at once (in a wide dtype)
_MEMCMP = memcmp()


def js(v: Any) -> Any:
    """A JSON-safe rendering of a value (non-finite floats as strings, others as repr)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)) and len(v) <= 16:
        return [js(x) for x in v]
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{type(v).__name__}({v.dtype}, {list(v.shape)})"
    text = repr(v)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass(frozen=True)
class TensorDiff:
    """Values of one tensor that differ: how many, by how much (``max_rel_diff`` is
    ``|a - b| / |b|``, inf where b is 0) and where first (C order), with both values there."""

    key: str
    dtype_a: str
    dtype_b: str
    numel: int
    differing: int
    max_abs_diff: float
    max_rel_diff: float
    first_index: tuple[int, ...]
    first_a: Any
    first_b: Any

    def to_dict(self) -> dict[str, Any]:
        return {k: js(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class CommonDiff:
    """One common-state field: ``kind`` is ``changed``, ``only_in_a``, ``only_in_b`` or
    ``not_compared`` (values of a type that cannot be compared; not a difference)."""

    path: str
    kind: str
    a: Any = None
    b: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "a": js(self.a), "b": js(self.b)}


def _cells(t: TensorMeta, u: TensorMeta) -> Iterator[Box]:
    """Cells of the union of both chunk grids (one cell: the whole tensor, when a side's
    chunks are in a reformulated stored shape or the union grid would be far finer)."""
    shape = t.shape
    whole = tuple((0, s) for s in shape)
    if t.stored_shape is not None or u.stored_shape is not None:
        yield whole
        return
    bounds = []
    for d, size in enumerate(shape):
        cuts = {0, size}
        for c in (*t.chunks, *u.chunks):
            cuts.update(x for x in (c.offsets[d], c.offsets[d] + c.sizes[d]) if 0 < x < size)
        bounds.append(sorted(cuts))
    if math.prod(len(b) - 1 for b in bounds) > 4 * (len(t.chunks) + len(u.chunks)) + 16:
        yield whole
        return
    for idx in itertools.product(*(range(len(b) - 1) for b in bounds)):
        yield tuple((bounds[d][i], bounds[d][i + 1]) for d, i in enumerate(idx))


def _slabs(box: Box, itemsize: int) -> Iterator[Box]:
    """``box`` cut into pieces of at most ``PIECE_BYTES`` (rows of the outermost dims)."""
    limit = PIECE_BYTES
    sizes = [b - a for a, b in box]
    if not box or math.prod(sizes) * itemsize <= limit:
        yield box
        return
    d = next((i for i in range(len(sizes)) if math.prod(sizes[i + 1:]) * itemsize <= limit),
             len(sizes) - 1)
    step = max(1, limit // max(1, math.prod(sizes[d + 1:]) * itemsize))
    for pre in itertools.product(*(range(a, b) for a, b in box[:d])):
        for s in range(box[d][0], box[d][1], step):
            yield (tuple((i, i + 1) for i in pre) + ((s, min(s + step, box[d][1])),)
                   + tuple(box[d + 1:]))


def _inside(box: Box, boxes: set[Box]) -> bool:
    return box in boxes or any(all(a <= x and y <= b for (x, y), (a, b) in zip(box, o))
                               for o in boxes)


def _same_bytes(a: Any, b: Any) -> bool:
    """Two contiguous tensors of one dtype hold the same bytes (``memcmp``: torch.equal is
    several times slower on CPU)."""
    import torch

    n = a.numel() * a.element_size()
    if _MEMCMP is not None and n:
        return _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _compare(a: Any, b: Any, atol: float, rtol: float) -> tuple[int, float, float, int] | None:
    """(differing, max abs diff, max rel diff, first flat index) of two same-shape tensors, or
    None when equal: within ``atol + rtol * |b|``, NaN == NaN at the same position."""
    import torch

    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    if a.dtype == b.dtype and _same_bytes(a, b):
        return None
    if a.is_complex() or b.is_complex():
        wide = torch.complex128
    elif a.is_floating_point() or b.is_floating_point():
        wide = torch.float64
    else:
        wide = torch.int64
    count, max_abs, max_rel, first = 0, 0.0, 0.0, -1
    for s in range(0, a.numel(), _ELEMS):
        x, y = a[s:s + _ELEMS].to(wide), b[s:s + _ELEMS].to(wide)
        same = x == y
        if wide != torch.int64:
            same |= torch.isnan(x) & torch.isnan(y)
        d = (x - y).abs().to(torch.float64)
        ref = y.abs().to(torch.float64)
        if atol or rtol:
            same |= d <= atol + rtol * ref
        bad = ~same
        k = int(bad.sum())
        if not k:
            continue
        if first < 0:
            first = s + int(torch.argmax(bad.to(torch.uint8)))
        count += k
        dd = torch.nan_to_num(d[bad], nan=math.inf)
        max_abs = max(max_abs, float(dd.max()))
        max_rel = max(max_rel, float((dd / ref[bad]).nan_to_num(nan=math.inf).max()))
    return None if not count else (count, max_abs, max_rel, first)


def _unravel(flat: int, box: Box) -> tuple[int, ...]:
    idx = []
    for a, b in reversed(box):
        flat, r = divmod(flat, b - a)
        idx.append(a + r)
    return tuple(reversed(idx))


def compare_values(name: str, ka: str, ta: TensorMeta, tb: TensorMeta, ra: Any, rb: Any,
                   proven: set[Box], atol: float, rtol: float,
                   tick: Callable[[int, str | None], None],
                   observe: Callable[[Any, Any], None] | None = None) -> TensorDiff | None:
    """Element-wise comparison of tensor ``ka`` of reader ``ra`` with ``name`` of ``rb`` over
    the pieces not in ``proven`` (boxes the byte path proved equal); ``tick(nbytes, None)``
    after each piece, ``observe(a, b)`` with each pair of pieces read. None when equal."""
    size = max(dtype_itemsize(ta.dtype), dtype_itemsize(tb.dtype))
    count, max_abs, max_rel, first, fa, fb = 0, 0.0, 0.0, None, None, None
    for cell in _cells(ta, tb):
        if proven and ta.stored_shape is None and _inside(cell, proven):
            continue
        for box in _slabs(cell, size) if ta.stored_shape is None else [cell]:
            sl = tuple(slice(a, b) for a, b in box)
            x, y = ra.read(ka, sl), rb.read(name, sl)
            if observe is not None:
                observe(x, y)
            found = _compare(x, y, atol, rtol)
            tick(x.numel() * x.element_size() + y.numel() * y.element_size(), None)
            if found is None:
                continue
            count += found[0]
            max_abs, max_rel = max(max_abs, found[1]), max(max_rel, found[2])
            at = _unravel(found[3], box)
            if first is None or at < first:
                first = at
                fa, fb = x.reshape(-1)[found[3]].item(), y.reshape(-1)[found[3]].item()
            del x, y
    if not count:
        return None
    return TensorDiff(name, ta.dtype, tb.dtype, ta.numel, count, max_abs, max_rel,
                      first or (), fa, fb)


def _flatten(obj: Any, prefix: str, out: dict[str, Any], depth: int = 0) -> dict[str, Any]:
    if type(obj).__name__ == "Namespace" and hasattr(obj, "__dict__"):
        obj = vars(obj)
    if isinstance(obj, dict) and obj and depth < 8:
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    else:
        out[prefix] = obj
    return out


def _same(x: Any, y: Any) -> bool | None:
    """Equal, different, or None when the values cannot be compared."""
    prim = (type(None), bool, int, float, str, bytes)
    if hasattr(x, "item") and not hasattr(x, "shape") or getattr(x, "shape", None) == ():
        x = x.item() if hasattr(x, "item") else x
    if hasattr(y, "item") and not hasattr(y, "shape") or getattr(y, "shape", None) == ():
        y = y.item() if hasattr(y, "item") else y
    if isinstance(x, prim) and isinstance(y, prim):
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            return True
        return x == y
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return False
        verdicts = [_same(p, q) for p, q in zip(x, y)]
        return False if False in verdicts else (None if None in verdicts else True)
    if isinstance(x, dict) and isinstance(y, dict):
        if set(x) != set(y):
            return False
        return _same([x[k] for k in sorted(x, key=str)], [y[k] for k in sorted(y, key=str)])
    if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(y, "shape"):
        if str(x.dtype) != str(y.dtype) or tuple(x.shape) != tuple(y.shape):
            return False
        try:
            return bytes(x.numpy().tobytes() if hasattr(x, "numpy") else x.tobytes()) == bytes(
                y.numpy().tobytes() if hasattr(y, "numpy") else y.tobytes())
        except Exception:  # noqa: BLE001 - an exotic array type: say it was not compared
            return None
    if type(x) is not type(y):
        return False if isinstance(x, prim) or isinstance(y, prim) else None
    from ckpt_tool.formats.containers.pickle.safe_pickle import StandIn

    if isinstance(x, StandIn):  # an object of a class not imported: equal when its state is
        return _same(x.fields(), y.fields())
    try:
        eq = x == y
        return eq if isinstance(eq, bool) else None
    except Exception:  # noqa: BLE001
        return None


def same_common_file(ma: CheckpointMeta, mb: CheckpointMeta) -> bool:
    """Both sides are MCore dist checkpoints whose ``common.pt`` files are byte-identical (then
    loading them, which needs torch, is not needed to know the common states are equal) and
    intact (their CRC-32s: IntegrityError when not)."""
    if not (ma.kind.megatron_dist and mb.kind.megatron_dist):
        return False
    fa, fb = Path(ma.root) / "common.pt", Path(mb.root) / "common.pt"
    try:
        same = fa.stat().st_size == fb.stat().st_size and fa.read_bytes() == fb.read_bytes()
    except OSError:
        return False
    if same:
        check_file(fa, "common.pt")
    return same


def compare_common(ca: dict[str, Any], cb: dict[str, Any]) -> list[CommonDiff]:
    """Every field of the flattened common states that differs (or cannot be compared)."""
    fa, fb = _flatten(ca, "", {}), _flatten(cb, "", {})
    out = []
    for p in sorted(set(fa) | set(fb)):
        if p not in fb:
            out.append(CommonDiff(p, "only_in_a", fa[p]))
        elif p not in fa:
            out.append(CommonDiff(p, "only_in_b", None, fb[p]))
        else:
            v = _same(fa[p], fb[p])
            if v is not True:
                out.append(CommonDiff(p, "changed" if v is False else "not_compared",
                                      fa[p], fb[p]))
    return out


def _object_bytes(meta: CheckpointMeta, unique_key: str) -> bytes | None:
    """The stored bytes of one object, or None when they cannot be located."""
    o = next((o for o in meta.objects if o.unique_key == unique_key), None)
    if o is None or o.file is None or o.byte_length is None:
        return None
    try:
        with open(Path(meta.root) / o.file, "rb") as f:
            f.seek(o.byte_offset or 0)
            data = f.read(o.byte_length)
    except OSError:
        return None
    return data if len(data) == o.byte_length else None


def compare_objects(pairs: dict[str, str], ma: CheckpointMeta, mb: CheckpointMeta, ra: Any,
                    rb: Any) -> list[CommonDiff]:
    """Payload differences of the objects both sides hold (``{B unique key: A unique key}``):
    paths are ``<B unique key>`` or ``<B unique key>.<field>``; an unreadable or unsafe object
    raises the reader's error (CorruptCheckpointError, UnsafePickleError)."""
    out: list[CommonDiff] = []
    for kb in sorted(pairs):
        ka = pairs[kb]
        raw_a = _object_bytes(ma, ka)
        if raw_a is not None and raw_a == _object_bytes(mb, kb):
            if raw_a[:4] == b"PK\x03\x04":  # a torch.save item: intact, or an error
                check_archive(raw_a, f"object {ka}", path=ma.root)
            continue  # the same stored bytes: the same payload, nothing unpickled
        pa, pb = ra.read_object(ka), rb.read_object(kb)
        if isinstance(pa, list) and isinstance(pb, list) and len(pa) == len(pb):
            pa, pb = dict(enumerate(pa)), dict(enumerate(pb))  # MCore's [rng state dict]
        out += [CommonDiff(f"{kb}.{c.path}" if c.path else kb, c.kind, c.a, c.b)
                for c in compare_common({"": pa}, {"": pb})]
    return out
