"""NaN/Inf counting for the bulk path of the integrity pass (``_scan_vector``).

:func:`finite` proves a buffer free of NaN/Inf with two integer max reductions (SIMD, exact: no
float sum that could overflow); only a buffer that is not gets counted element by element
(``_checks.count_nonfinite``). :func:`crc_and_pool` CRCs and counts many small tensors, with a
copy and a test per megabyte; :func:`big_tensor` CRCs and counts a big one slab by slab.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ckpt_tool._crc import crc32
from ckpt_tool.ops.validate._checks import _BITS, count_nonfinite

__all__ = ["finite", "counts", "crc_records", "crc_and_pool", "big_tensor", "describe_all",
           "byte_rows"]

_POOL = 1 << 20  # small tensors are counted in buffers this big

# dtype -> (signed view, unsigned view, positive bound, negative bound): an element is NaN/Inf
# when its bits read as the signed integer are >= the positive bound (exponent all ones, sign
# clear) or read as the unsigned one >= the negative bound (the same with the sign set).
_MAX_TEST: dict[str, tuple[str, str, int, int]] = {
    name: (udt.replace("u", "i"), udt, mask, (1 << (np.dtype(udt).itemsize * 8 - 1)) | mask)
    for name, (udt, mask, value, _) in _BITS.items() if mask == value}


def finite(data: Any, dtype: str) -> bool:
    """True when the little-endian ``dtype`` elements of ``data`` hold no NaN and no Inf (also
    for dtypes without them); False when some element may be one (then count it)."""
    spec = _MAX_TEST.get(dtype)
    if spec is None:
        return dtype not in _BITS or count_nonfinite(data, dtype) == (0, 0)
    if len(data) == 0:
        return True
    sdt, udt, pos, neg = spec
    return bool(np.frombuffer(data, sdt).max() < pos and np.frombuffer(data, udt).max() < neg)


def counts(data: Any, dtype: str) -> tuple[int, int]:
    """``(NaN, Inf)`` of ``data`` (the exact count only when :func:`finite` fails)."""
    return (0, 0) if finite(data, dtype) else count_nonfinite(data, dtype)


def crc_records(mv: memoryview, start: list[int], end: list[int], crc: list[int]) -> list[int]:
    """The indices of the records ``[start[i], end[i])`` of ``mv`` whose CRC32 is not
    ``crc[i]``."""
    return [j for j, a, b, c in zip(range(len(start)), start, end, crc) if crc32(mv[a:b]) != c]


def crc_and_pool(mv: memoryview, start: np.ndarray, nbytes: np.ndarray, crc: np.ndarray,
                 data: np.ndarray, size: np.ndarray, rows: np.ndarray, dtype: str,
                 nan: np.ndarray, inf: np.ndarray) -> list[int]:
    """For each small tensor, in order: the CRC32 of its record ``[start, start + nbytes)``
    of ``mv``, then its ``size`` bytes at ``data`` copied (while in cache) into a buffer that
    is tested in one go when full; only a buffer that is not all finite has its members
    counted apart (into ``nan[rows]``, ``inf[rows]``). Returns the indices of the records
    whose CRC is not ``crc``."""
    bad: list[int] = []
    size_l = size.tolist()
    pool = np.empty(_POOL, np.uint8)
    first = fill = 0

    def test(last: int) -> None:
        if last > first and not finite(pool[:fill], dtype):
            at = 0
            for j in range(first, last):
                n = size_l[j]
                nan[rows[j]], inf[rows[j]] = count_nonfinite(pool[at:at + n], dtype)
                at += n

    with memoryview(pool) as dst:
        for j, s, e, c, a, n in zip(range(len(size_l)), start.tolist(), (start + nbytes).tolist(),
                                    crc.tolist(), data.tolist(), size_l):
            if crc32(mv[s:e]) != c:
                bad.append(j)
            if fill + n > _POOL:
                test(j)
                first, fill = j, 0
                if n > _POOL:  # bigger than the buffer: counted in place
                    nan[rows[j]], inf[rows[j]] = counts(mv[a:a + n], dtype)
                    first = j + 1
                    continue
            dst[fill:fill + n] = mv[a:a + n]
            fill += n
        test(len(size_l))
    return bad


def big_tensor(rec: memoryview, lo: int, hi: int, dtype: str, slab: int
               ) -> tuple[int, tuple[int, int] | None]:
    """``(CRC32 of rec, (NaN, Inf) of bytes [lo, hi))``, a slab at a time: each slab counted
    right after its CRC, while in cache (None: could not be counted)."""
    crc, nan, inf = 0, 0, 0
    for s in range(0, len(rec), slab):
        with rec[s:s + slab] as part:
            crc = crc32(part, crc)
            a, b = max(s, lo) - s, min(s + len(part), hi) - s
            if a < b:
                try:
                    with part[a:b] as data:
                        n, i = counts(data, dtype)
                except Exception:  # noqa: BLE001 - left to the per-item path
                    return crc32(rec), None
                nan, inf = nan + n, inf + i
    return crc, (nan, inf)


def byte_rows(arr: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """Bytes ``[s, s + width)`` of ``arr`` (bytes) for each ``s`` of ``start`` (clipped into
    ``arr``), one row each: one gather over a view of every ``width``-byte window of ``arr``."""
    last = len(arr) - width
    if last < 0 or width <= 0:
        return np.zeros((len(start), max(width, 0)), np.uint8)
    windows = np.ndarray((last + 1, width), np.uint8, arr, 0, (1, 1))  # read-only, like arr
    return windows[np.minimum(np.maximum(start, 0), last)]


def describe_all(arr: np.ndarray, start: np.ndarray, size: np.ndarray, crc: np.ndarray,
                 describe: Callable) -> tuple[np.ndarray, list[tuple[int, Any]]]:
    """``(ids, infos)`` of the records ``[start, start + size)`` of ``arr`` (a ``data.pkl``
    each) whose CRC32 should be ``crc``: ``infos[ids[i]]`` is ``(CRC32, describe(bytes))`` of
    record ``i``, computed once for all the records of the same size and recorded CRC that
    are the same bytes as the first of them; a record that is not gets ``(-1, None)``."""
    key = (size << 32) | crc
    _, first, ids = np.unique(key, return_index=True, return_inverse=True)
    infos: list[tuple[int, Any]] = []
    for s, z in zip(start[first].tolist(), size[first].tolist()):
        raw = arr[s:s + z].tobytes()
        infos.append((crc32(raw), describe(raw)))
    width = int(size.max()) if len(size) else 0
    rep = first[ids]
    data = byte_rows(arr, start, width)
    differ = ((data != data[rep]) & (np.arange(width) < size[:, None])).any(axis=1)
    near = start + width > len(arr)  # rows clipped by byte_rows: compared one by one
    for i, j in zip(*(x[near | near[rep]].tolist() for x in (np.arange(len(ids)), rep))):
        differ[i] = arr[start[i]:start[i] + size[i]].tobytes() != \
            arr[start[j]:start[j] + size[j]].tobytes()
    ids[differ] = len(infos)
    infos.append((-1, None))
    return ids, infos
