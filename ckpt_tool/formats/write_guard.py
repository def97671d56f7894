"""Writes through torch's C++ zip writer that fail cleanly when the disk fills up.

``torch.save`` into a path hands the file to a C++ writer; when a write fails (ENOSPC, EFBIG
under a file size limit) it raises "enforce fail at inline_container.cc ... unexpected pos",
losing the cause, and its destructor retries the failed write and aborts the whole process
(``terminate called after throwing an instance of 'c10::Error'``). :class:`GuardedStream`
sits between that writer and the file: the first failed write is remembered and every later
one is accepted and dropped, so torch finishes without throwing; the caller then raises the
real ``OSError`` (:meth:`GuardedStream.check`), which the staging layer reports as one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["GuardedStream", "torch_save_file", "finish_failed_writer"]


class GuardedStream:
    """A binary file wrapper for torch's writers (see the module docstring)."""

    def __init__(self, f: BinaryIO, path: str | os.PathLike | None = None):
        self._f = f
        self._path = None if path is None else os.fspath(path)
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.error is None:
            try:
                self._f.write(data)
            except OSError as exc:
                self.error = exc
        return n

    def flush(self) -> None:
        if self.error is None:
            try:
                self._f.flush()
            except OSError as exc:
                self.error = exc

    def __getattr__(self, name: str) -> Any:  # tell, fileno, ... of the real file
        return getattr(self._f, name)

    def check(self) -> None:
        """Raise the first failed write's OSError (with the file's name), if any."""
        if self.error is not None:
            exc = self.error
            raise OSError(exc.errno, exc.strerror, self._path or exc.filename) from None


def torch_save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` that raises the real OSError when a write fails (the archive
    is named ``archive/``, as for any stream ``torch.save`` writes into)."""
    import torch

    with open(path, "wb") as f:
        guard = GuardedStream(f, Path(path))
        try:
            torch.save(obj, guard)
        except RuntimeError:
            guard.check()  # the cause, if a write failed
            raise
        guard.check()


def finish_failed_writer(writer: Any, path: str | os.PathLike, exc: BaseException) -> None:
    """After a ``torch._C.PyTorchFileWriter`` writing to ``path`` raised ``exc``: finalize it
    (a failed finalize still marks it finished, so its destructor does not retry and abort),
    then raise the OSError behind a short write — ENOSPC when the file system is full, EFBIG
    at the file size limit — or return (the caller re-raises ``exc``)."""
    import errno
    import resource
    import shutil

    try:
        writer.write_end_of_file()
    except Exception:  # noqa: BLE001 - the first error is the one to report
        pass
    if not isinstance(exc, RuntimeError):
        return
    path = os.fspath(path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        size = os.path.getsize(path)
        free = shutil.disk_usage(os.path.dirname(path) or ".").free
    except OSError:
        return
    if limit != resource.RLIM_INFINITY and size >= limit - (1 << 16):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), path) from None
    if free < (1 << 20):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path) from None
