"""Byte ranges of two files compared in bounded windows, by a few threads, without torch.

A *spec* ``(file_a, offset_a, runs, file_b, offset_b)`` asks whether the runs ``(start, n)`` at
``offset_a + start`` of ``file_a``, in order, equal the contiguous bytes from ``offset_b`` of
``file_b``. :func:`compare_all` answers for a list of specs:

* each spec is cut into windows of at most ``block`` bytes of A (``_BLOCK`` shared by the
  threads); consecutive windows on the same two files whose bytes lie within one block on each
  side (back-to-back items of a checkpoint and its copy) share one pair of mappings;
* up to ``_MAX_THREADS`` threads take those units in order from one list (``mmap`` and the
  ``memcmp`` called through ctypes release the GIL) and skip the windows of a spec that is
  already known to differ; each thread maps two units at most at a time, unmapped at once, so
  the mapped total stays about ``2 * _BLOCK`` whatever the thread count;
* where no C library can be called, bytes go through two reused read buffers per thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

__all__ = ["compare_all", "memcmp", "Spec"]

_BLOCK = 16 << 20  # bytes of A mapped at once, all threads together (as much of B)
_MAX_THREADS = 4

Spec = tuple[Path, int, list[tuple[int, int]], Path, int]
# A window: one spec's runs within one block, its index in front (same fields otherwise).
Window = tuple[int, Path, int, list[tuple[int, int]], Path, int]


def memcmp() -> Any:
    """libc ``memcmp(a, b, n)`` through ctypes, or None where there is no C library handle."""
    try:
        import ctypes

        f = ctypes.CDLL(None).memcmp
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return f
    except (OSError, AttributeError, TypeError):  # no C library handle (Windows): read()
        return None


def _windows(job: int, pa: Path, oa: int, runs: list[tuple[int, int]], pb: Path, ob: int,
             block: int) -> list[Window]:
    """Spec ``job`` cut into windows of at most ``block`` bytes of A."""
    out: list[Window] = []
    group: list[tuple[int, int]] = []
    for st, n in ((st + i, min(block, n - i)) for st, n in runs for i in range(0, n, block)):
        if group and st + n - group[0][0] > block:
            out.append((job, pa, oa, group, pb, ob))
            ob += sum(k for _, k in group)
            group = []
        group.append((st, n))
    if group:
        out.append((job, pa, oa, group, pb, ob))
    return out


def _span(w: Window) -> tuple[int, int, int, int]:
    """``(a_lo, a_hi, b_lo, b_hi)``: the bytes window ``w`` covers in each file."""
    _, _, oa, group, _, ob = w
    return (oa + group[0][0], oa + group[-1][0] + group[-1][1], ob,
            ob + sum(n for _, n in group))


def _units(windows: list[Window], block: int) -> list[list[Window]]:
    """Consecutive windows on the same two files within one block on each side, grouped."""
    units: list[list[Window]] = []
    box = (0, 0, 0, 0)
    for w in windows:
        s = _span(w)
        if units and units[-1][0][1] == w[1] and units[-1][0][4] == w[4]:
            lo_a, hi_a = min(box[0], s[0]), max(box[1], s[1])
            lo_b, hi_b = min(box[2], s[2]), max(box[3], s[3])
            if hi_a - lo_a <= block and hi_b - lo_b <= block:
                units[-1].append(w)
                box = (lo_a, hi_a, lo_b, hi_b)
                continue
        units.append([w])
        box = s
    return units


class _Bytes:
    """One thread's comparer: ``memcmp`` over two mappings (unmapped at once), or
    ``readinto`` two reused buffers where there is no C library to call."""

    def __init__(self, block: int) -> None:
        self.memcmp = memcmp()
        self.buf = (bytearray(block), bytearray(block)) if self.memcmp is None else None
        self.files: dict[tuple[int, Path], Any] = {}  # one handle per side, even for A == B

    def _f(self, side: int, path: Path) -> Any:
        f = self.files.get((side, path))
        if f is None:
            if len(self.files) >= 64:
                self.files.pop(next(iter(self.files))).close()
            f = self.files[side, path] = open(path, "rb", buffering=0)
        return f

    def equal(self, unit: list[Window], skip: list[bool]) -> list[bool]:
        """Per window of ``unit``: its bytes are equal on both sides (False for a window in
        ``skip``, and on a short file: the element-wise path then reports it properly)."""
        try:
            fa, fb = self._f(0, unit[0][1]), self._f(1, unit[0][4])
            if self.buf is not None:
                return [not s and self._read(fa, w, fb) for w, s in zip(unit, skip)]
            return self._mapped(fa, fb, unit, skip)
        except (OSError, ValueError):  # a short file: each window alone says which
            if len(unit) == 1:
                return [False]
            return [self.equal([w], [s])[0] for w, s in zip(unit, skip)]

    def _read(self, fa: Any, w: Window, fb: Any) -> bool:
        _, _, oa, group, _, ob = w
        ba, bb = self.buf
        for st, n in group:
            fa.seek(oa + st)
            fb.seek(ob)
            with memoryview(ba) as ma, memoryview(bb) as mb:
                if fa.readinto(ma[:n]) != n or fb.readinto(mb[:n]) != n:
                    return False
            if not (ba == bb if n == len(ba) else ba[:n] == bb[:n]):
                return False
            ob += n
        return True

    def _mapped(self, fa: Any, fb: Any, unit: list[Window], skip: list[bool]) -> list[bool]:
        import ctypes
        import mmap

        spans = [_span(w) for w in unit]
        lo_a, hi_a = min(s[0] for s in spans), max(s[1] for s in spans)
        lo_b, hi_b = min(s[2] for s in spans), max(s[3] for s in spans)
        g = mmap.ALLOCATIONGRANULARITY
        pa, pb = lo_a % g, lo_b % g
        # ACCESS_COPY: a private map ctypes may address; nothing is ever written to it.
        with mmap.mmap(fa.fileno(), hi_a - lo_a + pa, offset=lo_a - pa,
                       access=mmap.ACCESS_COPY) as ma, \
                mmap.mmap(fb.fileno(), hi_b - lo_b + pb, offset=lo_b - pb,
                          access=mmap.ACCESS_COPY) as mb:
            ca, cb = ctypes.c_char.from_buffer(ma), ctypes.c_char.from_buffer(mb)
            try:
                base_a, base_b = ctypes.addressof(ca) + pa - lo_a, ctypes.addressof(cb) + pb - lo_b
                out = []
                for (_, _, oa, group, _, ob), s in zip(unit, skip):
                    same = not s
                    for st, n in group if same else ():
                        if self.memcmp(base_a + oa + st, base_b + ob, n):
                            same = False
                            break
                        ob += n
                    out.append(same)
                return out
            finally:
                del ca, cb

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _threads(nbytes: int) -> int:
    """Comparison threads: the CPUs this process may use (shared with the other torchrun
    ranks of this node), at most ``_MAX_THREADS``, none idle for want of windows."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(1, min(_MAX_THREADS, cpus // local, nbytes // _BLOCK + 1))


def compare_all(specs: list[Spec], done: Callable[[int], None]) -> list[bool]:
    """Verdict per spec: all its bytes equal. ``done(i)`` is called (under a lock, from any of
    the threads) as soon as spec ``i`` is proven equal."""
    import threading

    threads = _threads(sum(n for s in specs for _, n in s[2]))
    block = max(1, _BLOCK // threads)
    windows = [_windows(j, *s, block) for j, s in enumerate(specs)]
    ok = [True] * len(specs)
    left = [len(ws) for ws in windows]
    for j, n in enumerate(left):
        if not n:
            done(j)
    queue = iter(_units([w for ws in windows for w in ws], block))
    lock, errors, stop = threading.Lock(), [], [False]

    def work() -> None:
        cmp = _Bytes(block)
        try:
            while not stop[0]:
                with lock:
                    unit = next(queue, None)
                if unit is None:
                    return
                skip = [not ok[w[0]] for w in unit]
                same = cmp.equal(unit, skip) if not all(skip) else [False] * len(unit)
                with lock:
                    for w, s in zip(unit, same):
                        j = w[0]
                        ok[j] = ok[j] and s
                        left[j] -= 1
                        if not left[j] and ok[j]:
                            done(j)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)
            stop[0] = True
        finally:
            cmp.close()

    if threads == 1:
        work()
    else:
        pool = [threading.Thread(target=work, name=f"ckpt-diff-{i}", daemon=True)
                for i in range(threads)]
        try:
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        finally:
            stop[0] = True
    if errors:
        raise errors[0]
    return ok
