"""Writes through torch's C++ zip writer that fail cleanly: a full disk, a file size limit or
Ctrl-C gives the real error, never an abort.

torch's zip writer (``PyTorchFileWriter``, under ``torch.save``) has two ways to kill the
process:

* a failed write leaves it unfinished, and its destructor finishes the archive, fails again
  and aborts (``terminate called after throwing an instance of 'c10::Error'``). An unfinished
  writer is finished here (:func:`finish_failed_writer`; ``torch.save``'s own context manager
  does the same), and the cause -- reported by torch only as "enforce fail at
  inline_container.cc ... unexpected pos" -- is recovered (:func:`raise_write_failure`);
* given a Python stream, it calls the stream's ``write`` from C code; an exception raised
  there (a KeyboardInterrupt from the Ctrl-C handler) cannot unwind through that C code and
  aborts. So files are handed to it by name (:func:`zip_writer_name`), and where a Python
  stream is unavoidable (DCP's item writer) the ``write`` calls run under
  ``ckpt_tool._program.interrupts_deferred``. :class:`GuardedStream` keeps a stream's first
  write error for the caller instead of raising it into torch. The writer's own methods are
  pybind11 calls, which abort the same way when the Ctrl-C handler raises while they convert
  their arguments (``pybind11::error_already_set``): they run under the same deferral
  (:func:`uninterrupted`; ``torch.save`` as a whole in :func:`torch_save_file`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from ckpt_tool._pause_points import pause_point
from ckpt_tool._program import interrupts_deferred

__all__ = ["GuardedStream", "torch_save_file", "finish_failed_writer", "raise_write_failure",
           "uninterrupted", "zip_writer_name"]


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


@contextlib.contextmanager
def zip_writer_name(path: str | os.PathLike) -> Iterator[Any]:
    """The name torch's zip writer opens ``path`` by. It takes ASCII names only (``torch.save``
    hands it a Python stream otherwise): a non-ASCII ``path`` is opened through an ASCII
    symlink named ``archive`` (the record prefix ``torch.save`` gives a stream, so the bytes
    are the same); a stream is the last resort."""
    path = os.fspath(path)
    if path.isascii():
        yield path
        return
    import shutil
    import tempfile

    link_dir = tempfile.mkdtemp(prefix="ckpt-zip-")
    link = os.path.join(link_dir, "archive")
    try:
        if link.isascii():
            os.symlink(os.path.abspath(path), link)
            yield link
        else:
            with open(path, "wb") as stream:
                yield stream
    finally:
        shutil.rmtree(link_dir, ignore_errors=True)


def uninterrupted(call: Any, *args: Any) -> Any:
    """``call(*args)`` with a Ctrl-C taking effect when it returns (see the module docstring)."""
    with interrupts_deferred():
        pause_point("deferred")
        return call(*args)


def torch_save_file(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)`` that raises the real OSError when a write fails (a Ctrl-C
    takes effect once the file is written); stand-ins of classes not imported pickle as what
    they stand for (``safe_pickle.pickle_module_for``)."""
    import torch

    from ckpt_tool.formats.containers.pickle.safe_pickle import pickle_module_for

    with zip_writer_name(path) as name:
        try:
            uninterrupted(lambda: torch.save(obj, name, pickle_module=pickle_module_for(obj)))
        except RuntimeError as exc:
            raise_write_failure(Path(path), exc)
            raise


def finish_failed_writer(writer: Any, path: str | os.PathLike, exc: BaseException) -> None:
    """After a ``torch._C.PyTorchFileWriter`` writing to ``path`` raised ``exc``: finalize it
    (a failed finalize still marks it finished, so its destructor does not retry and abort),
    then, for the writer's own RuntimeError, raise the OSError behind it
    (:func:`raise_write_failure`); otherwise return (the caller re-raises ``exc``)."""
    try:
        uninterrupted(writer.write_end_of_file)
    except Exception:  # noqa: BLE001 - the first error is the one to report
        pass
    if isinstance(exc, RuntimeError):
        raise_write_failure(path, exc)


def raise_write_failure(path: str | os.PathLike, exc: RuntimeError) -> None:
    """Raise the OSError behind torch's zip writer's RuntimeError ``exc`` on ``path``: ENOSPC
    when the file system is full, EFBIG at the file size limit; EIO naming torch's message
    when a write failed for another reason; return when ``exc`` is not a failed write."""
    import errno
    import resource
    import shutil

    path = os.fspath(path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        size = os.path.getsize(path)
        free = shutil.disk_usage(os.path.dirname(path) or ".").free
    except OSError:
        size, free = 0, 1 << 30
    if limit != resource.RLIM_INFINITY and size >= limit - (1 << 16):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), path) from None
    if free < (1 << 20):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path) from None
    reason = str(exc).split("\n", 1)[0]
    if "inline_container" in reason or "iostream error" in reason:
        raise OSError(errno.EIO, f"writing the archive failed ({reason}); is the disk full or "
                      "read-only?", path) from None
