"""Start writing a file's new bytes to disk while the writer goes on (Linux).

A file written through the page cache reaches the disk when the kernel decides (after
``vm.dirty_expire_centisecs``, or once ``vm.dirty_background_ratio`` of memory is dirty: many
GB on a big host) or at the final ``fsync``: a checkpoint of a few GB is then first copied into
memory and only then written, the disk idle during the first part and the CPU during the second.
``sync_file_range(SYNC_FILE_RANGE_WRITE)`` of what was just written starts its write-back at
once and returns (it waits only when the device's queue is full): writing overlaps producing,
and the ``fsync`` at the end, still made, finds little left to do. It changes nothing about
what is durable when. Elsewhere than Linux (or without the call) nothing happens.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable

__all__ = ["start_writeback", "Writeback", "WINDOW"]

WINDOW = 16 << 20  # write-back is started per this many new bytes
_SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing bytes ``[offset, offset + nbytes)`` of ``fd`` to disk (no wait for it to
    finish; errors are left to the ``fsync`` that follows)."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """For a file written from its start: :meth:`wrote` with how far it is written; the
    write-back of each further :data:`WINDOW` is started."""

    def __init__(self, fd: int):
        self.fd = fd
        self.started = 0

    def wrote(self, position: int) -> None:
        if position - self.started >= WINDOW:
            start_writeback(self.fd, self.started, position - self.started)
            self.started = position

