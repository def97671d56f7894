"""The fast path of ``diff``: prove pieces equal by comparing stored bytes, without torch.

:func:`fast_equal` pairs each chunk of A with B's chunk of the same box, or with the rows it
covers in B's unchunked tensor (and the reverse), and compares bytes:

* whole stored items when both sides store the box alike (same layout, transforms and length:
  DCP ``torch.save`` items, MCore flat pieces, exact raw ranges); equal bytes decode to equal
  tensors;
* otherwise the raw C-order elements of both: a raw chunk (safetensors, torch.save, legacy
  storages, zarr ``order: C`` without compressor), or the storage record inside a plain DCP
  item, located in place by ``formats.containers.torch_zip.torch_zip_read`` (optional: without it, such pieces are left
  to the element-wise path).

The byte ranges, ordered by A's file and offset, go to ``_windows.compare_all`` (bounded
mmap windows, a few threads, ``memcmp``). A piece whose bytes differ is not a difference yet:
the element-wise path (``_values``) decides (``-0.0 == 0.0``, NaN payloads, tolerances).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Callable

from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, dtype_itemsize
from ckpt_tool.ops.diff._windows import Spec, compare_all

__all__ = ["fast_equal", "Box"]

_MAX_RUNS = 4096  # most byte runs compared for one chunk inside an unchunked tensor

Box = tuple[tuple[int, int], ...]


def _base(meta: CheckpointMeta) -> Path:
    root = Path(meta.root)
    return root if root.is_dir() else root.parent


def _exact_raw(t: TensorMeta, c: ChunkRef) -> bool:
    """``c`` stores exactly its elements, C order, little-endian (zarr edge chunks are padded;
    zarr ``order: F`` is not C order)."""
    origin = t.origin or ""
    return (c.layout == "raw" and not c.transforms and c.byte_length is not None
            and c.byte_length == c.numel * dtype_itemsize(t.dtype)
            and (not origin.startswith("zarr:") or origin == "zarr:C"))


def _same_item(ta: TensorMeta, ca: ChunkRef, tb: TensorMeta, cb: ChunkRef) -> bool:
    """Both stored items can be compared as wholes: same layout, transforms and length (equal
    bytes then decode to equal tensors)."""
    if ca.layout != cb.layout or ca.transforms != cb.transforms or None in (
            ca.file, ca.byte_offset, ca.byte_length, cb.file, cb.byte_offset, cb.byte_length):
        return False
    if ca.layout == "raw":
        return _exact_raw(ta, ca) and _exact_raw(tb, cb)
    return ca.byte_length == cb.byte_length


def _raw_range(base: Path, t: TensorMeta, c: ChunkRef) -> tuple[Path, int, int] | None:
    """``(file, offset, length)`` of the C-order elements of chunk ``c``: a raw chunk, or the
    storage record inside a plain ``torch.save`` item (parsed in place, torch-free); else None."""
    if c.file is None or c.byte_offset is None or c.byte_length is None:
        return None
    if _exact_raw(t, c):
        return base / c.file, c.byte_offset, c.byte_length
    if c.layout != "torch_save" or c.transforms or not c.byte_length:
        return None
    try:
        import mmap

        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import raw_item
        from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple
    except ImportError:  # the in-place reader is optional here: compare elements instead
        return None
    pad = c.byte_offset % mmap.ALLOCATIONGRANULARITY
    try:
        with open(base / c.file, "rb") as f, mmap.mmap(
                f.fileno(), c.byte_length + pad, offset=c.byte_offset - pad,
                access=mmap.ACCESS_READ) as mm:
            with memoryview(mm) as whole, whole[pad:] as view:
                raw = raw_item(view)
                shape, stride, first, start = raw.shape, raw.stride, raw.storage_offset, \
                    raw.record.start
                same_dtype = raw.dtype == t.dtype
                raw.data.release()
                del raw
    except (OSError, ValueError, BufferError, NotSimple):
        return None
    expect = 1
    for n, st in reversed(list(zip(shape, stride))):
        if n != 1 and st != expect:
            return None
        expect *= n
    if not same_dtype or expect != c.numel:
        return None
    size = dtype_itemsize(t.dtype)
    return base / c.file, c.byte_offset + start + first * size, c.numel * size


def _box_runs(shape: tuple[int, ...], box: ChunkRef, size: int) -> list[tuple[int, int]] | None:
    """Byte runs ``(start, n)`` of ``box`` inside a C-order tensor of ``shape``, in order; None
    when there would be more than ``_MAX_RUNS``."""
    k = len(shape)
    while k > 0 and box.sizes[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        return [(0, math.prod(shape) * size)]
    stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    if math.prod(box.sizes[:k - 1]) > _MAX_RUNS:
        return None
    run = box.sizes[k - 1] * stride[k - 1] * size
    return [((sum(i * stride[d] for d, i in enumerate(idx)) + box.offsets[k - 1] * stride[k - 1])
             * size, run)
            for idx in itertools.product(*(range(o, o + n) for o, n in
                                           zip(box.offsets[:k - 1], box.sizes[:k - 1])))]


def _whole(t: TensorMeta) -> ChunkRef | None:
    """The one chunk of an unchunked tensor (safetensors, torch.save, replicated legacy)."""
    c = t.chunks[0] if len(t.chunks) == 1 else None
    return c if c is not None and c.sizes == t.shape and not any(c.offsets) else None


def fast_equal(pairs: list[tuple[str, TensorMeta, TensorMeta]], ma: CheckpointMeta,
                mb: CheckpointMeta, tick: Callable[[int, str | None], None],
                check_a: Callable[[list[ChunkRef]], None] = lambda chunks: None,
                check_b: Callable[[list[ChunkRef]], None] = lambda chunks: None
                ) -> dict[str, set[Box]]:
    """Boxes proven equal by their stored bytes, per B-name: whole items when both sides store
    a box alike, else raw elements (a DCP item's storage record against a safetensors range;
    a chunk against its rows in the other side's unchunked tensor). ``check_a``/``check_b``
    (the readers' ``check_stored``) check the CRC-32s of the stored items of each side's
    chunks first: equal damaged bytes prove nothing."""
    todo = []
    for name, ta, tb in pairs:
        if ta.dtype != tb.dtype or ta.shape != tb.shape or ta.stored_shape != tb.stored_shape:
            continue
        by_box = {(c.offsets, c.sizes): c for c in tb.chunks}
        wa, wb = (_whole(ta), _whole(tb)) if ta.stored_shape is None else (None, None)
        for ca in ta.chunks:
            cb = by_box.pop((ca.offsets, ca.sizes), None) or wb
            if cb is not None:
                todo.append((str(ca.file), ca.byte_offset or 0, name, ta, ca, tb, cb))
        for cb in by_box.values() if wa is not None and wb is None else ():
            todo.append((str(wa.file), wa.byte_offset or 0, name, ta, wa, tb, cb))
    todo.sort(key=lambda t: (t[0], t[1]))
    check_a([t[4] for t in todo])
    check_b([t[6] for t in todo])
    base_a, base_b = _base(ma), _base(mb)
    equal: dict[str, set[Box]] = {}

    def proven(i: int) -> None:
        _, _, name, ta, ca, tb, cb = todo[i]
        part = cb if ca.sizes == ta.shape and cb.sizes != ta.shape else ca
        equal.setdefault(name, set()).add(
            tuple((o, o + s) for o, s in zip(part.offsets, part.sizes)))
        tick(2 * part.numel * dtype_itemsize(ta.dtype), None)

    # First whole items where both sides store a box alike, else raw elements; then raw
    # elements of the whole items whose bytes differ (another encoding of the same values).
    first = [_spec(base_a, base_b, t, whole=True) for t in todo]
    again = [i for i, ok in enumerate(_run(first, proven)) if not ok and first[i] is not None
             and first[i][1] and todo[i][3].stored_shape is None]
    second = [_spec(base_a, base_b, todo[i], whole=False) for i in again]
    _run(second, lambda k: proven(again[k]))
    return equal


def _spec(base_a: Path, base_b: Path, t: tuple, whole: bool) -> tuple[Spec, bool] | None:
    """The bytes to compare for one pair of chunks, and whether they are whole items."""
    _, _, _, ta, ca, tb, cb = t
    if ca.offsets == cb.offsets and ca.sizes == cb.sizes:
        if whole and _same_item(ta, ca, tb, cb):
            return ((base_a / str(ca.file), int(ca.byte_offset or 0),
                     [(0, int(ca.byte_length or 0))], base_b / str(cb.file),
                     int(cb.byte_offset or 0)), True)
        if ta.stored_shape is not None:
            return None
        xa, xb = _raw_range(base_a, ta, ca), _raw_range(base_b, tb, cb)
        if not (xa and xb and xa[2] == xb[2]):
            return None
        return (xa[0], xa[1], [(0, xa[2])], xb[0], xb[1]), False
    part = cb if ca.sizes == ta.shape and cb.sizes != ta.shape else ca
    xa, xb = _raw_range(base_a, ta, ca), _raw_range(base_b, tb, cb)
    runs = _box_runs(ta.shape, part, dtype_itemsize(ta.dtype))
    if not (xa and xb and runs is not None):
        return None
    spec = (xa[0], xa[1], runs, xb[0], xb[1]) if part is cb else (xb[0], xb[1], runs, xa[0],
                                                                   xa[1])
    return spec, False


def _run(specs: list[tuple[Spec, bool] | None], done: Callable[[int], None]) -> list[bool]:
    """``compare_all`` over the specs there are; False where there is none."""
    index = [i for i, s in enumerate(specs) if s is not None]
    ok = compare_all([specs[i][0] for i in index], lambda k: done(index[k]))
    out = [False] * len(specs)
    for i, v in zip(index, ok):
        out[i] = v
    return out
