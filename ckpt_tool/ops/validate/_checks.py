"""Pure checks of ``validate``: they work on the metadata model (and facts passed in), no I/O.

Each returns a list of :class:`Finding`; none raises on a bad checkpoint. Also the NaN/Inf
counting of ``--deep`` (on buffers handed in, e.g. views of a read-only mmap).
"""

from __future__ import annotations

import math
import threading
from ckpt_tool._crc import crc32
from typing import Any, Iterable, Mapping

from ckpt_tool.errors import plural
from ckpt_tool.model import DTYPE_ITEMSIZE, CheckpointMeta, ChunkRef, Finding, TensorMeta
from ckpt_tool.planning.overlap import grid_tiling

__all__ = ["error", "warning", "check_coverage", "check_storage",
           "check_expectations", "MAX_REPORTED", "nonfinite", "count_nonfinite", "count_slabs",
           "crc32_counting", "NonfiniteBatch"]

# At most this many findings of one kind per tensor (overlaps, out-of-bounds chunks).
MAX_REPORTED = 5


def error(message: str, *, key: str | None = None, file: str | None = None) -> Finding:
    return Finding("error", key, file, message)


def warning(message: str, *, key: str | None = None, file: str | None = None) -> Finding:
    return Finding("warning", key, file, message)


def _box(c: ChunkRef) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(c.offsets, c.sizes)) + "]"


def _overlaps(a: ChunkRef, b: ChunkRef) -> bool:
    return all(ao < bo + bs and bo < ao + as_
               for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _find_overlaps(chunks: list[ChunkRef], limit: int) -> list[tuple[ChunkRef, ChunkRef]]:
    """Pairs of overlapping chunks (at most ``limit``): a sweep along the dimension with the
    most distinct offsets, comparing each chunk only with those still open along it."""
    if len(chunks) < 2:
        return []
    ndim = len(chunks[0].offsets)
    if ndim == 0:
        return [(chunks[0], chunks[1])]
    dim = max(range(ndim), key=lambda d: len({c.offsets[d] for c in chunks}))
    ordered = sorted(chunks, key=lambda c: c.offsets[dim])
    active: list[ChunkRef] = []
    found: list[tuple[ChunkRef, ChunkRef]] = []
    for c in ordered:
        start = c.offsets[dim]
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > start]
        for a in active:
            if _overlaps(a, c):
                found.append((a, c))
                if len(found) >= limit:
                    return found
        if c.sizes[dim] > 0:
            active.append(c)
    return found


def _union_volume(chunks: list[ChunkRef], shape: tuple[int, ...],
                  max_cells: int = 1 << 16) -> int | None:
    """Elements covered by the union of ``chunks`` (coordinate compression: each chunk marks
    its block of the compressed grid), or None when that grid would be too large."""
    import bisect
    import functools

    import numpy as np

    bounds = []
    for d in range(len(shape)):
        bounds.append(sorted({0, shape[d]} | {c.offsets[d] for c in chunks}
                             | {c.offsets[d] + c.sizes[d] for c in chunks}))
    if math.prod(len(b) - 1 for b in bounds) > max_cells:
        return None
    covered = np.zeros([len(b) - 1 for b in bounds], dtype=bool)
    for c in chunks:
        covered[tuple(slice(bisect.bisect_left(b, o), bisect.bisect_left(b, o + s))
                      for b, o, s in zip(bounds, c.offsets, c.sizes))] = True
    widths = [np.diff(np.asarray(b, dtype=np.int64)) for b in bounds]
    cell_volume = functools.reduce(np.multiply.outer, widths, np.int64(1))
    return int((cell_volume * covered).sum())


def check_coverage(t: TensorMeta) -> list[Finding]:
    """Every element of the (stored) global tensor is stored exactly once: chunks in bounds,
    no overlap, no gap; dtype known; ranks and reformulated shapes consistent."""
    out: list[Finding] = []
    key = t.key
    if t.dtype not in DTYPE_ITEMSIZE:
        out.append(error(f"unknown dtype {t.dtype!r}", key=key))
    shape = t.stored_shape if t.stored_shape is not None else t.shape
    where = "stored shape" if t.stored_shape is not None else "shape"
    if any(s < 0 for s in shape):
        return out + [error(f"negative size in {where} {list(shape)}", key=key)]
    if t.stored_shape is not None and math.prod(t.stored_shape) != math.prod(t.shape):
        out.append(error(f"stored shape {list(t.stored_shape)} does not hold the logical shape "
                         f"{list(t.shape)}", key=key))
    good: list[ChunkRef] = []
    bad = 0
    for c in t.chunks:
        problem = None
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            problem = (f"chunk at {list(c.offsets)} has rank {len(c.sizes)}, the tensor's "
                       f"{where} {list(shape)} has rank {len(shape)}")
        elif any(s < 0 for s in c.sizes) or any(o < 0 for o in c.offsets):
            problem = f"chunk {_box(c)} has a negative offset or size"
        elif any(o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
            problem = f"chunk {_box(c)} lies outside the {where} {list(shape)}"
        if problem is None:
            good.append(c)
            continue
        bad += 1
        if bad <= MAX_REPORTED:
            out.append(error(problem, key=key, file=c.file))
    if bad > MAX_REPORTED:
        out.append(error(f"{bad - MAX_REPORTED} more chunks out of bounds or of a wrong rank",
                         key=key))
    total = math.prod(shape)
    nonempty = [c for c in good if c.numel > 0]
    tiled = not bad and grid_tiling(shape, [(c.offsets, c.sizes) for c in nonempty])
    overlaps = [] if tiled else _find_overlaps(nonempty, MAX_REPORTED + 1)
    for a, b in overlaps[:MAX_REPORTED]:
        out.append(error(f"chunks {_box(a)} and {_box(b)} overlap", key=key, file=b.file))
    if len(overlaps) > MAX_REPORTED:
        out.append(error("more overlapping chunks not listed", key=key))
    covered = sum(c.numel for c in nonempty)
    if overlaps and not bad:
        union = _union_volume(nonempty, shape)
        if union is not None and union < total:
            out.append(error(f"chunks cover {union} of {total} elements ({where} "
                             f"{list(shape)}): a gap besides the overlap", key=key))
    if not overlaps and not bad and covered < total:
        if not t.chunks:
            out.append(error(f"no chunk stored for a tensor of {plural(total, 'element')}",
                             key=key))
        else:
            out.append(error(f"chunks cover {covered} of {total} elements ({where} "
                             f"{list(shape)}): a gap, some chunks are missing", key=key))
    elif not overlaps and not bad and covered > total:  # cannot happen without overlap
        out.append(error(f"chunks hold {covered} elements for {total}", key=key))
    return out


def check_storage(meta: CheckpointMeta, sizes: Mapping[str, int | None]) -> list[Finding]:
    """Every file a chunk or object names exists (``sizes[file]`` is not None) and holds every
    item's byte range; raw untransformed chunks hold exactly ``numel * itemsize`` bytes."""
    out: list[Finding] = []
    missing: dict[str, set[str]] = {}  # file -> keys whose items it holds
    # file -> [(key, what, off, end)] of items past the end of the file (one finding per file)
    short: dict[str, list[tuple[str, str, int, int]]] = {}

    def one(key: str, file: str | None, off: int | None, length: int | None, what: str) -> None:
        if file is None:
            out.append(error(f"{what} has no storage location in the metadata", key=key))
            return
        size = sizes.get(file)
        if size is None:
            missing.setdefault(file, set()).add(key)
            return
        if off is None or length is None:
            return
        if off < 0 or length < 0:
            out.append(error(f"{what} has a negative byte range", key=key, file=file))
        elif off + length > size:
            short.setdefault(file, []).append((key, what, off, off + length))

    for key in sorted(meta.tensors):
        t = meta.tensors[key]
        itemsize = DTYPE_ITEMSIZE.get(t.dtype)
        for c in t.chunks:
            one(key, c.file, c.byte_offset, c.byte_length, f"chunk {_box(c)}")
            if (c.layout == "raw" and not c.transforms and itemsize is not None
                    and c.byte_length is not None and c.byte_length != c.numel * itemsize
                    and sizes.get(c.file or "") is not None):
                out.append(error(f"chunk {_box(c)} has {c.byte_length} bytes, "
                                 f"{c.numel} x {t.dtype} needs {c.numel * itemsize}",
                                 key=key, file=c.file))
    for o in meta.objects:
        one(o.unique_key, o.file, o.byte_offset, o.byte_length, "object")
    for file, keys in sorted(missing.items()):
        one_key = next(iter(keys)) if len(keys) == 1 else None
        out.append(error(f"data file {file} is missing" + (
            "" if one_key else f" (it holds items of {len(keys)} tensors/objects)"),
            key=one_key, file=file))
    for file, items in sorted(short.items()):
        size = sizes[file]
        key, what, off, end = min(items, key=lambda x: x[2])
        if size == 0:
            out.append(error(f"data file {file} is empty (0 bytes); it should hold "
                             f"{plural(len(items), 'item')} in "
                             f"{plural(max(x[3] for x in items), 'byte')} at least",
                             key=key if len(items) == 1 else None, file=file))
            continue
        if len(items) == 1:
            msg = f"{what} needs bytes [{off}, {end}), the file has {size}"
        else:
            msg = (f"{len(items)} items end past its {plural(size, 'byte')} (first: {what} of "
                   f"{key}, bytes [{off}, {end}); needs at least "
                   f"{plural(max(x[3] for x in items), 'byte')})")
        out.append(error(f"data file {file} is truncated: {msg}",
                         key=key if len(items) == 1 else None, file=file))
    return out


def check_expectations(meta: CheckpointMeta, *, expect_tp: int | None = None,
                       expect_pp: int | None = None, expect_keys: Iterable[str] | None = None,
                       expect_iteration: int | None = None) -> list[Finding]:
    """What the caller expects (parallel sizes, keys, iteration) against the metadata."""
    out: list[Finding] = []
    parallel = meta.common.get("parallel") or {}
    for name, want in (("tp", expect_tp), ("pp", expect_pp)):
        if want is None:
            continue
        have = parallel.get(name)
        if have is None:
            out.append(error(f"expected {name}={want} but the checkpoint records no {name} "
                             "(no parallel sizes in the common state)"))
        elif have != want:
            out.append(error(f"expected {name}={want}, the checkpoint was saved with "
                             f"{name}={have}"))
    if expect_keys is not None:
        present = set(meta.tensors) | {o.key for o in meta.objects} \
            | {o.unique_key for o in meta.objects}
        for k in expect_keys:
            if k not in present:
                out.append(error("expected key is missing from the checkpoint", key=k))
    if expect_iteration is not None:
        have = meta.common.get("iteration")
        if have is None:
            out.append(error(f"expected iteration {expect_iteration} but the checkpoint "
                             "records no iteration"))
        elif str(have) != str(expect_iteration):
            out.append(error(f"expected iteration {expect_iteration}, the checkpoint is at "
                             f"iteration {have}"))
    return out


# -- NaN/Inf counting (validate --deep): on raw bytes with numpy, no torch import ---------

_local = threading.local()  # per-thread scratch buffers


def nonfinite(t: Any) -> tuple[int, int]:
    """``(NaN count, Inf count)`` of a tensor (complex: per component), via
    :func:`count_slabs` on its bytes."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in _BITS or t.numel() == 0:
        return 0, 0
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return count_slabs(memoryview(flat.numpy()), name)


# dtype -> (unsigned view, mask, value, mantissa): an element is NaN/Inf when
# ``bits & mask == value``; a NaN when also ``bits & mantissa``, else an Inf (no mantissa: NaN).
_BITS: dict[str, tuple[str, int, int, int | None]] = {
    "float64": ("<u8", 0x7FF0000000000000, 0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "float32": ("<u4", 0x7F800000, 0x7F800000, 0x007FFFFF),
    "float16": ("<u2", 0x7C00, 0x7C00, 0x03FF),
    "bfloat16": ("<u2", 0x7F80, 0x7F80, 0x007F),
    "float8_e5m2": ("u1", 0x7C, 0x7C, 0x03),
    "float8_e4m3fn": ("u1", 0x7F, 0x7F, None),
    "float8_e4m3fnuz": ("u1", 0xFF, 0x80, None),
    "float8_e5m2fnuz": ("u1", 0xFF, 0x80, None),
}
_BITS["complex64"], _BITS["complex128"] = _BITS["float32"], _BITS["float64"]  # per component


def _scratch(nbytes: int) -> Any:
    """A per-thread numpy buffer of at least ``nbytes`` (uint8)."""
    import numpy as np

    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _local.buf = buf
    return buf[:nbytes]


def count_nonfinite(data: Any, dtype: str) -> tuple[int, int]:
    """``(NaN, Inf)`` among the little-endian ``dtype`` elements of the buffer ``data`` (whole
    elements; any alignment), with numpy (no torch import): a float32/64 sum, or for 16/8-bit
    floats an AND and a max of the exponent bits, proves the common all-finite case; only
    then are the exponent bits counted (exact)."""
    import numpy as np

    spec = _BITS.get(dtype)
    if spec is None or len(data) == 0:
        return 0, 0
    udt, mask, value, mant = spec
    if udt in ("<u4", "<u8"):  # float32/64: a sum (SIMD, no temporary) proves most slabs finite
        with np.errstate(all="ignore"):
            if np.isfinite(np.add.reduce(np.frombuffer(data, dtype=udt.replace("u", "f")))):
                return 0, 0
    bits = np.frombuffer(data, dtype=udt)
    tmp = _scratch(bits.nbytes).view(udt)
    np.bitwise_and(bits, np.array(mask, dtype=udt), out=tmp)
    if value == mask and tmp.max() != mask:
        return 0, 0
    hit = tmp == value
    n = int(np.count_nonzero(hit))
    if n == 0 or mant is None:
        return n, 0
    nan = int(np.count_nonzero(hit & (bits & np.array(mant, dtype=udt) != 0)))
    return nan, n - nan


def count_slabs(data: Any, dtype: str, slab: int = 4 << 20) -> tuple[int, int]:
    """:func:`count_nonfinite` of a big buffer, a slab at a time (bounded scratch memory)."""
    nan = inf = 0
    for s in range(0, len(data), slab):
        with data[s:s + slab] as part:
            n, i = count_nonfinite(part, dtype)
        nan, inf = nan + n, inf + i
    return nan, inf


def crc32_counting(rec: Any, span: tuple[int, int], dtype: str, slab: int = 4 << 20
                   ) -> tuple[int, tuple[int, int] | None]:
    """``(CRC32 of rec, (NaN, Inf) of its elements in the byte range span)``, one pass: each
    slab is counted right after its CRC, while it is in cache. The counts are None when they
    cannot be taken (the CRC always is)."""
    crc, counts = 0, [0, 0]
    a, b = span
    for s in range(0, len(rec), slab):
        with rec[s:s + slab] as part:
            crc = crc32(part, crc)
            lo, hi = max(s, a), min(s + len(part), b)
        if lo < hi and counts is not None:
            try:
                with rec[lo:hi] as data:
                    n, i = count_nonfinite(data, dtype)
                counts = [counts[0] + n, counts[1] + i]
            except Exception:  # noqa: BLE001 - left to the reader, which reports it
                counts = None
    return crc, None if counts is None else (counts[0], counts[1])


class NonfiniteBatch:
    """NaN/Inf counts of many small buffers with one reduction per dtype.

    ``add(tag, data, dtype)`` copies ``data`` (whole elements) into an aligned per-dtype
    buffer; when it is full, and at :meth:`flush`, the buffer is reduced once and, only if
    something in it is not finite, each member is counted apart. Results arrive through
    ``done(tag, nan, inf)``, one call per ``add``. Saves the per-call cost of torch on the
    thousands of tiny tensors (norms, biases) a checkpoint holds. Reusable after
    :meth:`flush` (``done`` may be reassigned); not thread-safe: one per thread.
    """

    def __init__(self, done: Any, capacity: int = 4 << 20):
        self.done, self._cap = done, capacity
        self._bufs: dict[str, list[Any]] = {}  # dtype -> [memoryview, uint8 tensor, fill, members]

    def add(self, tag: Any, data: Any, dtype: str) -> None:
        n = len(data)
        if dtype not in _BITS or n == 0 or n > self._cap:
            if dtype in _BITS and n:
                self.done(tag, *count_nonfinite(data, dtype))
            else:
                self.done(tag, 0, 0)
            return
        b = self._bufs.get(dtype)
        if b is None:
            import numpy as np

            store = np.empty(self._cap, dtype=np.uint8)
            b = self._bufs[dtype] = [memoryview(store), store, 0, []]
        if b[2] + n > self._cap:
            self._flush(dtype)
        b[0][b[2]:b[2] + n] = data
        b[3].append((tag, b[2], b[2] + n))
        b[2] += n

    def flush(self) -> None:
        """Reduce what is buffered (call once at the end)."""
        for dtype in list(self._bufs):
            self._flush(dtype)

    def _flush(self, dtype: str) -> None:
        b = self._bufs[dtype]
        if b[3]:
            nan, inf = count_nonfinite(b[1][:b[2]], dtype)
            for tag, lo, hi in b[3]:
                self.done(tag, *((0, 0) if nan == inf == 0 else count_nonfinite(b[1][lo:hi],
                                                                                  dtype)))
        b[2], b[3] = 0, []
