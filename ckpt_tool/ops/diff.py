"""``diff``: compare two checkpoints of any formats, streaming, and list every difference.

Call order: :func:`diff` opens both checkpoints, matches tensor keys (``rename`` prefixes are
applied to A's keys, ``filter`` to the matched names), reports keys on one side only, dtype and
shape changes, then compares values piece by piece:

1. fast path, no torch: when both sides store a chunk with the same box and dtype in a
   byte-comparable way (the same ``torch_save`` item layout, or exact raw little-endian
   elements), the stored bytes are compared (sequential reads, two reused 8 MiB buffers);
   byte-equal means value-equal;
2. every other piece (grids that differ, bytes that differ, a dtype change) is read with
   ``reader.read(key, slices)`` over the cells of the union of both chunk grids, cut into slabs
   of at most ``PIECE_BYTES``, and compared element-wise (NaN == NaN at the same position).

Then the common state: the full ``reader.common()`` of both sides (``args`` fields by name), or
the metadata summaries with ``keys_only``. A side without common state or without stored objects
(safetensors, a plain state dict) is not compared on that part (a note says so), so a dist
checkpoint and its safetensors export can be identical.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from ckpt_tool.errors import UsageError
from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, dtype_itemsize

__all__ = ["diff", "DiffResult", "TensorDiff", "MetaChange", "CommonDiff", "parse_rename"]

PIECE_BYTES = 64 << 20  # largest piece read per side in the element-wise path
_BLOCK = 16 << 20  # raw byte comparison window
_ELEMS = 1 << 22  # elements compared at once (in a wide dtype)

Box = tuple[tuple[int, int], ...]


class Progress(Protocol):
    """Progress sink (the CLI's ``progress_bar``): totals once, then bytes as they are read."""

    def start(self, total_bytes: int, total_tensors: int) -> None: ...

    def update(self, nbytes: int, tensors_done: int) -> None: ...


def _js(v: Any) -> Any:
    """A JSON-safe rendering of a value (non-finite floats as strings, others as repr)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)) and len(v) <= 16:
        return [_js(x) for x in v]
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        return f"{type(v).__name__}({v.dtype}, {list(v.shape)})"
    text = repr(v)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass(frozen=True)
class MetaChange:
    """A dtype or shape change of one tensor (``key`` in B's naming)."""

    key: str
    a: Any
    b: Any

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "a": _js(self.a), "b": _js(self.b)}


@dataclass(frozen=True)
class TensorDiff:
    """Values of one tensor that differ: how many, by how much and where first (C order)."""

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
        return {k: _js(getattr(self, k)) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class CommonDiff:
    """One common-state field: ``kind`` is ``changed``, ``only_in_a``, ``only_in_b`` or
    ``not_compared`` (values of a type that cannot be compared; not a difference)."""

    path: str
    kind: str
    a: Any = None
    b: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "kind": self.kind, "a": _js(self.a), "b": _js(self.b)}


@dataclass(frozen=True)
class DiffResult:
    """Everything ``diff`` found. ``identical`` is the exit-0 verdict."""

    a: str
    b: str
    format_a: str
    format_b: str
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    dtype_changes: tuple[MetaChange, ...] = ()
    shape_changes: tuple[MetaChange, ...] = ()
    values: tuple[TensorDiff, ...] = ()
    common: tuple[CommonDiff, ...] = ()
    objects_only_in_a: tuple[str, ...] = ()
    objects_only_in_b: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    stats: dict[str, int] = field(default_factory=dict)
    keys_only: bool = False
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def common_differences(self) -> tuple[CommonDiff, ...]:
        return tuple(c for c in self.common if c.kind != "not_compared")

    @property
    def counted_dtype_changes(self) -> tuple[MetaChange, ...]:
        """Dtype changes that make the checkpoints differ: all of them, except with a
        tolerance and values read, where the values decide."""
        tolerant = (self.atol > 0 or self.rtol > 0) and not self.keys_only
        return () if tolerant else self.dtype_changes

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.counted_dtype_changes
                    or self.shape_changes or self.values or self.common_differences
                    or self.objects_only_in_a or self.objects_only_in_b)

    def to_dict(self) -> dict[str, Any]:
        """The ``diff --json`` document."""
        return {
            "identical": self.identical, "a": self.a, "b": self.b,
            "format_a": self.format_a, "format_b": self.format_b,
            "keys_only": self.keys_only, "atol": self.atol, "rtol": self.rtol,
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
            "dtype_changes": [c.to_dict() for c in self.dtype_changes],
            "shape_changes": [c.to_dict() for c in self.shape_changes],
            "values": [v.to_dict() for v in self.values],
            "common": [c.to_dict() for c in self.common],
            "objects_only_in_a": list(self.objects_only_in_a),
            "objects_only_in_b": list(self.objects_only_in_b),
            "notes": list(self.notes), "stats": self.stats,
        }


def parse_rename(specs: Iterable[str]) -> list[tuple[str, str]]:
    """``["OLD=NEW", ...]`` -> ``[("OLD", "NEW"), ...]``; UsageError on a malformed one."""
    out = []
    for s in specs:
        old, sep, new = s.partition("=")
        if not sep or not old:
            raise UsageError(f"--rename {s!r}: expected OLD=NEW (a key prefix of A and its "
                             "name in B)")
        out.append((old, new))
    return out


def _renamer(rename: Iterable[tuple[str, str]]) -> Callable[[str], str]:
    pairs = list(rename)

    def apply(key: str) -> str:
        for old, new in pairs:
            if key.startswith(old):
                return new + key[len(old):]
        return key
    return apply


def _match(keys_a: Iterable[str], keys_b: Iterable[str], rn: Callable[[str], str],
           rx: re.Pattern[str] | None) -> tuple[dict[str, str], list[str], list[str], list[str]]:
    """``{B-name: A-key}`` of the common keys, then only-in-A (B-names), only-in-B."""
    named: dict[str, str] = {}
    for k in keys_a:
        n = rn(k)
        if n in named:
            raise UsageError(f"--rename maps both {named[n]!r} and {k!r} to {n!r}")
        named[n] = k
    if rx is not None:
        named = {n: k for n, k in named.items() if rx.search(n)}
        keys_b = [k for k in keys_b if rx.search(k)]
    sb = set(keys_b)
    common = {n: named[n] for n in sorted(named) if n in sb}
    return (common, sorted(n for n in named if n not in sb), sorted(sb - set(named)),
            sorted(common))


# -- fast path: compare stored bytes ---------------------------------------------------------

def _base(meta: CheckpointMeta) -> Path:
    root = Path(meta.root)
    return root if root.is_dir() else root.parent


def _byte_comparable(ta: TensorMeta, ca: ChunkRef, tb: TensorMeta, cb: ChunkRef) -> bool:
    if ca.layout != cb.layout or ca.transforms or cb.transforms or ca.layout == "flat":
        return False
    if None in (ca.file, ca.byte_offset, ca.byte_length, cb.file, cb.byte_offset,
                cb.byte_length) or ca.byte_length != cb.byte_length:
        return False
    if ca.layout == "raw":  # exact C-order elements only (zarr edge chunks are padded)
        exact = ca.numel * dtype_itemsize(ta.dtype)
        orders = {o for o in (ta.origin, tb.origin) if o and o.startswith("zarr:")}
        return ca.byte_length == exact and orders <= {"zarr:C"}
    return ca.layout == "torch_save"


def _memcmp() -> Any:
    try:
        import ctypes

        f = ctypes.CDLL(None).memcmp
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return f
    except (OSError, AttributeError, TypeError):  # no C library handle (Windows): read()
        return None


class _Bytes:
    """Equal-length byte ranges of two files compared without copies: ``memcmp`` over two
    mmap windows of at most ``_BLOCK`` bytes (unmapped at once, so RSS stays ~2 windows),
    or ``readinto`` two reused buffers where there is no C library to call."""

    def __init__(self) -> None:
        self.memcmp = _memcmp()
        self.buf = (bytearray(_BLOCK), bytearray(_BLOCK)) if self.memcmp is None else None
        self.files: dict[tuple[int, Path], Any] = {}  # one handle per side, even for A == B

    def _f(self, side: int, path: Path) -> Any:
        f = self.files.get((side, path))
        if f is None:
            if len(self.files) >= 64:
                self.files.pop(next(iter(self.files))).close()
            f = self.files[side, path] = open(path, "rb", buffering=0)
        return f

    def equal(self, pa: Path, oa: int, pb: Path, ob: int, length: int) -> bool:
        fa, fb = self._f(0, pa), self._f(1, pb)
        try:
            while length > 0:
                k = min(length, _BLOCK)
                if not self._window(fa, oa, fb, ob, k):
                    return False
                oa, ob, length = oa + k, ob + k, length - k
        except (OSError, ValueError):  # short file: the element-wise path reports it properly
            return False
        return True

    def _window(self, fa: Any, oa: int, fb: Any, ob: int, k: int) -> bool:
        import mmap

        if self.memcmp is None:
            ba, bb = self.buf
            fa.seek(oa)
            fb.seek(ob)
            with memoryview(ba) as ma, memoryview(bb) as mb:
                if fa.readinto(ma[:k]) != k or fb.readinto(mb[:k]) != k:
                    return False
            return ba == bb if k == _BLOCK else ba[:k] == bb[:k]
        import ctypes

        g = mmap.ALLOCATIONGRANULARITY
        pa, pb = oa - oa % g, ob - ob % g
        # ACCESS_COPY: a private map ctypes may address; nothing is ever written to it.
        with mmap.mmap(fa.fileno(), k + oa - pa, offset=pa, access=mmap.ACCESS_COPY) as ma, \
                mmap.mmap(fb.fileno(), k + ob - pb, offset=pb, access=mmap.ACCESS_COPY) as mb:
            ca, cb = ctypes.c_char.from_buffer(ma), ctypes.c_char.from_buffer(mb)
            try:
                return self.memcmp(ctypes.addressof(ca) + oa - pa,
                                   ctypes.addressof(cb) + ob - pb, k) == 0
            finally:
                del ca, cb

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _fast_equal(pairs: list[tuple[str, TensorMeta, TensorMeta]], ma: CheckpointMeta,
                mb: CheckpointMeta, tick: Callable[[int, str | None], None]
                ) -> dict[str, set[Box]]:
    """Boxes proven equal by their stored bytes, per B-name."""
    todo, size = [], {}
    for name, ta, tb in pairs:
        size[name] = dtype_itemsize(ta.dtype)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or ta.stored_shape != tb.stored_shape:
            continue
        by_box = {(c.offsets, c.sizes): c for c in tb.chunks}
        for ca in ta.chunks:
            cb = by_box.get((ca.offsets, ca.sizes))
            if cb is not None and _byte_comparable(ta, ca, tb, cb):
                todo.append((str(ca.file), ca.byte_offset, name, ca, cb))
    todo.sort(key=lambda t: (t[0], t[1]))
    equal: dict[str, set[Box]] = {}
    cmp, base_a, base_b = _Bytes(), _base(ma), _base(mb)
    try:
        for _, _, name, ca, cb in todo:
            if cmp.equal(base_a / str(ca.file), int(ca.byte_offset or 0), base_b / str(cb.file),
                         int(cb.byte_offset or 0), int(ca.byte_length or 0)):
                box = tuple((o, o + s) for o, s in zip(ca.offsets, ca.sizes))
                equal.setdefault(name, set()).add(box)
                tick(2 * ca.numel * size[name], None)
    finally:
        cmp.close()
    return equal


# -- element-wise path -----------------------------------------------------------------------

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
    d = next(i for i in range(len(sizes)) if math.prod(sizes[i + 1:]) * itemsize <= limit)
    step = max(1, limit // max(1, math.prod(sizes[d + 1:]) * itemsize))
    for pre in itertools.product(*(range(a, b) for a, b in box[:d])):
        for s in range(box[d][0], box[d][1], step):
            yield (tuple((i, i + 1) for i in pre) + ((s, min(s + step, box[d][1])),)
                   + tuple(box[d + 1:]))


def _inside(box: Box, boxes: set[Box]) -> bool:
    return box in boxes or any(all(a <= x and y <= b for (x, y), (a, b) in zip(box, o))
                               for o in boxes)


def _compare(a: Any, b: Any, atol: float, rtol: float) -> tuple[int, float, float, int] | None:
    """(differing, max abs diff, max rel diff, first flat index) of two same-shape tensors, or
    None when equal: within ``atol + rtol * |b|``, NaN == NaN at the same position."""
    import torch

    a, b = a.reshape(-1), b.reshape(-1)
    if a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
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


def _values(name: str, ka: str, ta: TensorMeta, tb: TensorMeta, ra: Any, rb: Any,
            proven: set[Box], atol: float, rtol: float, tick: Callable[[int, str | None], None]
            ) -> TensorDiff | None:
    """Element-wise comparison of one tensor over the pieces not proven equal by bytes."""
    size = max(dtype_itemsize(ta.dtype), dtype_itemsize(tb.dtype))
    count, max_abs, max_rel, first, fa, fb = 0, 0.0, 0.0, None, None, None
    for cell in _cells(ta, tb):
        if proven and ta.stored_shape is None and _inside(cell, proven):
            continue
        for box in _slabs(cell, size) if ta.stored_shape is None else [cell]:
            sl = tuple(slice(a, b) for a, b in box)
            x, y = ra.read(ka, sl), rb.read(name, sl)
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


# -- common state ----------------------------------------------------------------------------

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
    try:
        eq = x == y
        return eq if isinstance(eq, bool) else None
    except Exception:  # noqa: BLE001
        return None


def _same_common_file(ma: CheckpointMeta, mb: CheckpointMeta) -> bool:
    """Both sides are MCore dist checkpoints whose ``common.pt`` files are byte-identical (then
    loading them, which needs torch, is not needed to know the common states are equal)."""
    if {ma.format, mb.format} - {"torch_dist", "zarr"}:
        return False
    fa, fb = Path(ma.root) / "common.pt", Path(mb.root) / "common.pt"
    try:
        return fa.stat().st_size == fb.stat().st_size and fa.read_bytes() == fb.read_bytes()
    except OSError:
        return False


def _common(ca: dict[str, Any], cb: dict[str, Any]) -> list[CommonDiff]:
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


# -- the operation ---------------------------------------------------------------------------

def diff(a: str | Path, b: str | Path, *, rename: Iterable[tuple[str, str]] = (),
         filter: str | None = None, keys_only: bool = False, atol: float = 0.0,
         rtol: float = 0.0, trust: bool = False, progress: Progress | None = None
         ) -> DiffResult:
    """Compare checkpoint ``a`` with ``b`` (see the module docstring); ``progress`` is told the
    bytes read (both sides) and the tensors finished."""
    from ckpt_tool.formats.base import open_checkpoint

    if atol < 0 or rtol < 0:
        raise UsageError("--atol and --rtol must be >= 0")
    try:
        rx = None if filter is None else re.compile(filter)
    except re.error as exc:
        raise UsageError(f"--filter {filter!r} is not a valid regular expression ({exc})") from None
    rn = _renamer(rename)
    with open_checkpoint(a, trust=trust) as ra, open_checkpoint(b, trust=trust) as rb:
        ma, mb = ra.metadata(), rb.metadata()
        common, only_a, only_b, names = _match(ma.tensors, mb.tensors, rn, rx)
        pairs = [(n, ma.tensors[common[n]], mb.tensors[n]) for n in names]
        dtypes = tuple(MetaChange(n, t.dtype, u.dtype) for n, t, u in pairs if t.dtype != u.dtype)
        shapes = tuple(MetaChange(n, t.shape, u.shape) for n, t, u in pairs if t.shape != u.shape)
        notes: list[str] = []
        oa = [o.unique_key for o in ma.objects]
        ob = [o.unique_key for o in mb.objects]
        obj_a: list[str] = []
        obj_b: list[str] = []
        if oa and ob:
            _, obj_a, obj_b, _ = _match(oa, ob, rn, rx)
        elif oa or ob:
            notes.append(f"stored objects not compared: {'B' if oa else 'A'} has none")
        same_shape = [(n, t, u) for n, t, u in pairs if t.shape == u.shape]
        stats = {"tensors_common": len(pairs), "tensors_compared": 0, "tensors_equal_bytes": 0,
                 "bytes_compared": 0}
        values: list[TensorDiff] = []
        if keys_only:
            notes.append("--keys-only: values not compared")
        else:
            if progress is not None:
                progress.start(sum(t.nbytes + u.nbytes for _, t, u in same_shape),
                               len(same_shape))
            done = [0, 0]

            def tick(nbytes: int, finished: str | None) -> None:
                done[0] += nbytes
                done[1] += finished is not None
                if progress is not None:
                    progress.update(nbytes, done[1])

            proven = _fast_equal(same_shape, ma, mb, tick)
            for n, t, u in same_shape:
                eq = proven.get(n, set())
                if not (eq and len(eq) == len(t.chunks) == len(u.chunks)):
                    found = _values(n, common[n], t, u, ra, rb, eq, atol, rtol, tick)
                    if found is not None:
                        values.append(found)
                else:
                    stats["tensors_equal_bytes"] += 1
                stats["tensors_compared"] += 1
                tick(0, n)
            stats["bytes_compared"] = done[0]
        cdiffs: list[CommonDiff] = []
        if rx is not None:
            notes.append("--filter: common state not compared")
        elif keys_only or not _same_common_file(ma, mb):
            ca = {k: v for k, v in ma.common.items() if k != "keys"} if keys_only else ra.common()
            cb = {k: v for k, v in mb.common.items() if k != "keys"} if keys_only else rb.common()
            if ca and cb:
                cdiffs = _common(ca, cb)
            elif ca or cb:
                notes.append(f"common state not compared: {'B' if ca else 'A'} has none")
        if any(c.kind == "not_compared" for c in cdiffs):
            notes.append("some common-state values cannot be compared (listed as not_compared)")
    return DiffResult(
        str(a), str(b), ma.format, mb.format, tuple(only_a), tuple(only_b), dtypes, shapes,
        tuple(values), tuple(cdiffs), tuple(obj_a), tuple(obj_b), tuple(notes), stats,
        keys_only, float(atol), float(rtol))
