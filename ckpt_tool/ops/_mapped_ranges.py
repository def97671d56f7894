"""Byte ranges of many files, mapped read-only back to back in one ``mmap``.

The bulk path of the integrity pass (``_scan_vector``) handles thousands of small items with a
fixed number of numpy operations; with one mapping per file it would need one per file as well.
:func:`map_ranges` reserves one anonymous read-only ``mmap.mmap`` and maps each file range over
its place in it (``mmap(2)`` with ``MAP_FIXED``, through ``ctypes``), page aligned: one buffer
then covers every file, and closing that ``mmap`` object unmaps them all (Python's export
tracking still refuses to close it while views exist). Where libc's ``mmap`` cannot be called
(Windows), each range gets a ``mmap`` of its own.

Ranges of objects on an object store (``ckpt_tool.storage``) are fetched instead, all at once
with parallel ranged GETs, into one buffer laid out the same way (:class:`Fetched`).

Filling the page tables of a mapping (~0.4 us a page) and tearing them down cost about as much
as the CRC of the bytes: with ``populate=False`` the caller can have :func:`prefault` (one
``madvise(MADV_POPULATE_READ)``) and ``mmap.close`` done on another thread, without the GIL,
while it checks another batch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ckpt_tool.storage import is_remote

__all__ = ["map_ranges", "prefault", "Fetched"]

_MAP_FIXED = 0x10  # the same on Linux, macOS and the BSDs
_POPULATE = 64 << 20  # ranges up to this size are mapped in one go, not page by page
_ALIGN = mmap.ALLOCATIONGRANULARITY
_MADV_POPULATE_READ = 22  # Linux >= 5.14 (EINVAL before: the pages are faulted in on use)


def _libc(name: str, restype: Any, *argtypes: Any) -> Any:
    if not sys.platform.startswith(("linux", "darwin", "freebsd")):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = restype, argtypes
    return fn


_mmap_fixed = _libc("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                    ctypes.c_int, ctypes.c_int, ctypes.c_int64)
_madvise = _libc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int) \
    if sys.platform.startswith("linux") else None


def _populate(length: int) -> int:
    return getattr(mmap, "MAP_POPULATE", 0) if length <= _POPULATE else 0


def map_ranges(ranges: list[tuple[Path, int, int]], populate: bool = True
               ) -> list[tuple[mmap.mmap, list[int | None]]]:
    """Map bytes ``[lo, hi)`` of each ``(path, lo, hi)`` (``lo`` a multiple of
    ``mmap.ALLOCATIONGRANULARITY``). Returns ``(mmap, at)`` pairs, together covering every
    range: ``at[i]`` is where byte ``lo`` of range ``i`` lies in that ``mmap``, None for ranges
    mapped elsewhere or not at all (the file is missing, shorter than ``hi`` or cannot be
    mapped). ``populate``: page tables filled now (else on first use, or :func:`prefault`).
    The caller closes each ``mmap``."""
    if ranges and is_remote(ranges[0][0]):
        return _fetch(ranges)
    if _mmap_fixed is None:
        return _map_each(ranges)
    fds: list[int | None] = []
    places: list[int] = []
    total = 0
    try:
        for path, lo, hi in ranges:
            fds.append(_open(path, hi))
            places.append(total)
            total += -(-(hi - lo) // mmap.PAGESIZE) * mmap.PAGESIZE
        if not total:
            return []
        try:
            region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        except OSError:  # no room for the whole range: one mapping per file range
            return _map_each(ranges)
        view = np.frombuffer(region, np.uint8)
        base = view.ctypes.data
        del view
        at: list[int | None] = []
        for fd, place, (_, lo, hi) in zip(fds, places, ranges):
            flags = mmap.MAP_SHARED | _MAP_FIXED | (_populate(hi - lo) if populate else 0)
            if fd is None or hi <= lo or _mmap_fixed(base + place, hi - lo, mmap.PROT_READ, flags,
                                                     fd, lo) != base + place:
                at.append(None)  # MAP_FIXED may have unmapped the place: never read there
            else:
                at.append(place)
        return [(region, at)]
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


class Fetched(bytearray):
    """Bytes of object ranges fetched into memory, in place of a mapping (``close`` is
    there for the callers that close what :func:`map_ranges` gives)."""

    def close(self) -> None:
        pass


def _fetch(ranges: list[tuple[Any, int, int]]) -> list[tuple[Any, list[int | None]]]:
    from ckpt_tool.storage.s3 import fetch_into

    places, total = [], 0
    for _, lo, hi in ranges:
        places.append(total)
        total += max(0, hi - lo)
    if not total:
        return []
    region = Fetched(total)
    view = memoryview(region)
    jobs = [(path, lo, view[place:place + hi - lo])
            for (path, lo, hi), place in zip(ranges, places)]
    try:
        got = fetch_into([j for j, (_, lo, hi) in zip(jobs, ranges) if hi > lo])
    except FileNotFoundError:
        got = None
    view.release()
    del jobs
    if got is None:  # an object gone: each range alone, the missing ones left out
        out = []
        for i, one in enumerate(ranges if len(ranges) > 1 else ()):
            for region, at1 in _fetch([one]):
                out.append((region, [None] * i + at1 + [None] * (len(ranges) - i - 1)))
        return out
    it = iter(got)
    at = [place if hi > lo and next(it) == hi - lo else None
          for (_, lo, hi), place in zip(ranges, places)]
    return [(region, at)]


def prefault(region: mmap.mmap) -> None:
    """Fill the page tables of ``region`` (a :func:`map_ranges` mapping) in one system call,
    without the GIL; best effort: pages it leaves are faulted in on first use."""
    if _madvise is None or not isinstance(region, mmap.mmap) or not len(region):
        return
    view = np.frombuffer(region, np.uint8)
    addr = view.ctypes.data
    del view
    _madvise(addr, len(region), _MADV_POPULATE_READ)


def _map_each(ranges: list[tuple[Path, int, int]]) -> list[tuple[mmap.mmap, list[int | None]]]:
    return [(m, [None] * i + [0] + [None] * (len(ranges) - i - 1))
            for i, m in enumerate(_map_one(*r) for r in ranges) if m is not None]


def _open(path: Path, hi: int) -> int | None:
    """A read-only descriptor of ``path`` if it holds at least ``hi`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size >= hi:
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _map_one(path: Path, lo: int, hi: int) -> mmap.mmap | None:
    fd = _open(path, hi) if hi > lo else None
    if fd is None:
        return None
    try:
        return mmap.mmap(fd, hi - lo, offset=lo, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
