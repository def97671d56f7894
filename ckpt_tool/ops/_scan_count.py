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
from ckpt_tool.ops._checks import _BITS, count_nonfinite

__all__ = ["finite", "counts", "crc_records", "crc_and_pool", "big_tensor", "describe_all"]

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


def describe_all(buf: Any, start: np.ndarray, size: np.ndarray, describe: Callable
                 ) -> tuple[np.ndarray, list[tuple[int, Any]]]:
    """``(ids, infos)``: the ``data.pkl`` at ``[start, start + size)`` of ``buf`` is the
    ``ids[i]``-th distinct one; ``infos[id]`` its ``(CRC32, describe(bytes))``."""
    seen: dict[bytes, int] = {}
    infos: list[tuple[int, Any]] = []
    ids = []
    for s, e in zip(start.tolist(), (start + size).tolist()):
        raw = buf[s:e]
        i = seen.get(raw)
        if i is None:
            i = seen[raw] = len(infos)
            infos.append((crc32(raw), describe(raw)))
        ids.append(i)
    return np.array(ids, dtype=np.int64), infos
