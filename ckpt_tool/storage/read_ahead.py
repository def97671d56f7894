"""Read-ahead for sequential ranged reads of objects (``ckpt_tool.storage.s3``).

A convert reads a DCP file's items one after another; each ranged GET waits for the store. A
read of :data:`AHEAD_FROM` bytes or more that starts where an earlier read of the object ended
belongs to a sequential stream, and the next :data:`AHEAD` bytes of that stream are fetched in
the background.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

__all__ = ["ReadAhead", "AHEAD", "AHEAD_STREAMS", "AHEAD_FROM"]

AHEAD = int(os.environ.get("CKPT_S3_READ_AHEAD", 8 << 20))  # bytes kept in flight per stream
AHEAD_STREAMS = 8
AHEAD_FROM = 256 << 10  # smaller reads (metadata, small items) never start a window


class ReadAhead:
    """Sequential reads of an object (the items of a DCP file read in file order by a
    convert) are latency-bound: each waits for its GET. A read of :data:`AHEAD_FROM` bytes or
    more that starts where an earlier read of the object ended belongs to a sequential stream
    (an object may carry several, interleaved: one per tensor kind); for it the next
    :data:`AHEAD` bytes are kept in flight in the background (GETs of ``part`` bytes, handed
    to the caller's thread pool), and a read inside them is copied from them. At most :data:`AHEAD_STREAMS` windows are held (the oldest is
    dropped) and a window's parts are dropped once read past: memory stays bounded."""

    def __init__(self, part: int) -> None:
        self.part = part
        self._lock = threading.Lock()
        self._ends: dict[tuple[str, int], None] = {}  # (key, end of a read), oldest first
        self._windows: list[tuple[str, list[tuple[int, int, Any]]]] = []  # (key, parts)

    def _find(self, key: str, offset: int) -> int | None:
        for i, (k, parts) in enumerate(self._windows):
            if k == key and parts and parts[0][0] <= offset < parts[-1][0] + parts[-1][1]:
                return i
        return None

    def take(self, key: str, offset: int, view: memoryview) -> int | None:
        """Copy what a window of ``key`` holds of ``[offset, offset + len(view))``, from its
        start, into ``view``: the bytes copied (the caller reads the rest), or None when no
        window holds ``offset``."""
        with self._lock:
            i = self._find(key, offset)
            if i is None:
                return None
            parts = self._windows[i][1]
            stop = min(offset + len(view), parts[-1][0] + parts[-1][1])
            need = [p for p in parts if p[0] < stop and p[0] + p[1] > offset]
            rest = [p for p in parts if p[0] + p[1] > stop]
            if rest:
                self._windows[i] = (key, rest)
            else:
                del self._windows[i]
        done = 0
        for at, n, fut in need:
            try:
                data = fut.result()
            except BaseException:  # noqa: BLE001 - read again in the caller's thread
                return None
            lo, hi = max(offset, at), min(stop, at + len(data))
            if hi < min(stop, at + n):
                return None  # the object ended inside: the plain read says how
            view[lo - offset:hi - offset] = data[lo - at:hi - at]
            done += hi - lo
        return done

    def after(self, store: Any, key: str, offset: int, n: int, got: int,
              submit: Callable[..., Any]) -> None:
        """Note a read of ``key``; keep :data:`AHEAD` bytes in flight after it (``store.get``
        of parts, through ``submit``) when it continues a sequential stream."""
        end = offset + got
        with self._lock:
            sequential = self._ends.pop((key, offset), 0) is None and got == n >= AHEAD_FROM
            self._ends[(key, end)] = None
            if len(self._ends) > 64:
                self._ends.pop(next(iter(self._ends)))
            if not sequential or AHEAD <= 0:
                return
            i = self._find(key, end)
            parts = self._windows.pop(i)[1] if i is not None else []
            ahead = parts[-1][0] + parts[-1][1] if parts else end
            if ahead - end < AHEAD // 2:
                more = AHEAD - (ahead - end)
                step = self.part
                parts = parts + [(ahead + s, min(step, more - s),
                                  submit(store.get, key, ahead + s, min(step, more - s)))
                                 for s in range(0, more, step)]
            self._windows.append((key, parts))
            if len(self._windows) > AHEAD_STREAMS:
                self._windows.pop(0)
