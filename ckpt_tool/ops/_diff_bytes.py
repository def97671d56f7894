"""The fast path of ``diff``: prove pieces equal by comparing stored bytes, without torch.

:func:`fast_equal` pairs each chunk of A with B's chunk of the same box, or with the rows it
covers in B's unchunked tensor (and the reverse), and compares bytes:

* whole stored items when both sides store the box alike (same layout, transforms and length:
  DCP ``torch.save`` items, MCore flat pieces, exact raw ranges); equal bytes decode to equal
  tensors;
* otherwise the raw C-order elements of both: a raw chunk (safetensors, torch.save, legacy
  storages, zarr ``order: C`` without compressor), or the storage record inside a plain DCP
  item, located in place by ``formats._dcp_raw`` (optional: without it, such pieces are left
  to the element-wise path).

Bytes are compared with ``memcmp`` over two mmap windows of at most ``_BLOCK`` bytes that are
unmapped at once (peak RSS ~ two windows), or through two reused buffers where no C library
can be called. A piece whose bytes differ is not a difference yet: the element-wise path
(``_diff_values``) decides (``-0.0 == 0.0``, NaN payloads, tolerances).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Callable

from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, dtype_itemsize

__all__ = ["fast_equal", "memcmp", "Box"]

_BLOCK = 16 << 20  # byte comparison window
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

        from ckpt_tool.formats._dcp_raw import NotSimple, raw_item
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


def memcmp() -> Any:
    """libc ``memcmp(a, b, n)`` through ctypes, or None where there is no C library handle."""
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
        self.memcmp = memcmp()
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
        """``length`` bytes at ``oa`` of ``pa`` equal those at ``ob`` of ``pb``."""
        return self.equal_runs(pa, oa, [(0, length)], pb, ob)

    def equal_runs(self, pa: Path, oa: int, runs: list[tuple[int, int]], pb: Path,
                   ob: int) -> bool:
        """The runs ``(start, n)`` at ``oa + start`` of ``pa``, in order, equal the bytes
        from ``ob`` of ``pb`` (one contiguous range); compared in windows of ``_BLOCK``."""
        fa, fb = self._f(0, pa), self._f(1, pb)
        cut = [(st + i, min(_BLOCK, n - i)) for st, n in runs for i in range(0, n, _BLOCK)]
        try:
            group: list[tuple[int, int]] = []
            for st, n in cut:
                if group and st + n - group[0][0] > _BLOCK:
                    if not self._group(fa, oa, group, fb, ob):
                        return False
                    ob += sum(k for _, k in group)
                    group = []
                group.append((st, n))
            return not group or self._group(fa, oa, group, fb, ob)
        except (OSError, ValueError):  # short file: the element-wise path reports it properly
            return False

    def _group(self, fa: Any, oa: int, group: list[tuple[int, int]], fb: Any, ob: int) -> bool:
        import mmap

        total = sum(n for _, n in group)
        if self.memcmp is None:
            ba, bb = self.buf
            for st, n in group:
                fa.seek(oa + st)
                fb.seek(ob)
                with memoryview(ba) as ma, memoryview(bb) as mb:
                    if fa.readinto(ma[:n]) != n or fb.readinto(mb[:n]) != n:
                        return False
                if not (ba == bb if n == _BLOCK else ba[:n] == bb[:n]):
                    return False
                ob += n
            return True
        import ctypes

        g = mmap.ALLOCATIONGRANULARITY
        start_a = oa + group[0][0]
        pa, pb = start_a % g, ob % g
        span = group[-1][0] + group[-1][1] - group[0][0]
        # ACCESS_COPY: a private map ctypes may address; nothing is ever written to it.
        with mmap.mmap(fa.fileno(), span + pa, offset=start_a - pa,
                       access=mmap.ACCESS_COPY) as ma, \
                mmap.mmap(fb.fileno(), total + pb, offset=ob - pb, access=mmap.ACCESS_COPY) as mb:
            ca, cb = ctypes.c_char.from_buffer(ma), ctypes.c_char.from_buffer(mb)
            try:
                xa, xb = ctypes.addressof(ca) + pa - group[0][0], ctypes.addressof(cb) + pb
                for st, n in group:
                    if self.memcmp(xa + st, xb, n):
                        return False
                    xb += n
                return True
            finally:
                del ca, cb

    def close(self) -> None:
        for f in self.files.values():
            f.close()


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
                mb: CheckpointMeta, tick: Callable[[int, str | None], None]
                ) -> dict[str, set[Box]]:
    """Boxes proven equal by their stored bytes, per B-name: whole items when both sides store
    a box alike, else raw elements (a DCP item's storage record against a safetensors range;
    a chunk against its rows in the other side's unchunked tensor)."""
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
    equal: dict[str, set[Box]] = {}
    cmp, base_a, base_b = _Bytes(), _base(ma), _base(mb)
    try:
        for _, _, name, ta, ca, tb, cb in todo:
            size = dtype_itemsize(ta.dtype)
            part = cb if ca.sizes == ta.shape and cb.sizes != ta.shape else ca
            if ca.offsets == cb.offsets and ca.sizes == cb.sizes:
                same = _same_item(ta, ca, tb, cb) and cmp.equal(
                    base_a / str(ca.file), int(ca.byte_offset or 0), base_b / str(cb.file),
                    int(cb.byte_offset or 0), int(ca.byte_length or 0))
                if not same and ta.stored_shape is None:
                    xa, xb = _raw_range(base_a, ta, ca), _raw_range(base_b, tb, cb)
                    same = bool(xa and xb and xa[2] == xb[2] and cmp.equal(*xa[:2], *xb))
            else:
                xa, xb = _raw_range(base_a, ta, ca), _raw_range(base_b, tb, cb)
                runs = _box_runs(ta.shape, part, size)
                same = bool(xa and xb and runs is not None) and (
                    cmp.equal_runs(xa[0], xa[1], runs, xb[0], xb[1]) if part is cb
                    else cmp.equal_runs(xb[0], xb[1], runs, xa[0], xa[1]))
            if same:
                equal.setdefault(name, set()).add(
                    tuple((o, o + s) for o, s in zip(part.offsets, part.sizes)))
                tick(2 * part.numel * size, None)
    finally:
        cmp.close()
    return equal
