"""File digests computed while the file is written, for the integrity manifest
(``ckpt_tool.integrity_manifest``): the manifest then costs no second pass over the output.

:class:`FollowingDigest` runs a thread that reads a file behind its writer (``os.pread`` of
what the writer says is on disk: the page cache, 8 MiB at a time) and hashes it, so hashing
overlaps writing instead of following it; what it hashes is what the file holds. The writer
:func:`note` s the result; ``build_manifest`` uses a noted digest when the file still has
the size and modification time it had when noted (:func:`noted`), else reads the file.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from typing import Any, Iterator

from ckpt_tool._crc import crc32
from ckpt_tool.writeback import Writeback

__all__ = ["FollowingDigest", "DigestedFile", "digested_file", "note", "noted", "take", "give"]

_BLOCK = 8 << 20
_SLICE = 32 << 20  # big buffers are written in slices: the digest follows each
_LOCK = threading.Lock()
# absolute path -> (algorithm, size, mtime_ns, hex digest)
_NOTED: dict[str, tuple[str, int, int, str]] = {}


class FollowingDigest:
    """The digest (``"sha256"`` or ``"crc32"``) of the file ``path`` being written; call
    :meth:`advance` with how many bytes are on disk, :meth:`finish` once all are."""

    def __init__(self, path: str | os.PathLike, algorithm: str):
        self.path = os.path.abspath(os.fspath(path))
        self.algorithm = algorithm
        self._hash = hashlib.sha256() if algorithm == "sha256" else None
        self._crc = 0
        self._done = 0
        self._written = 0
        self._closed = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._thread = threading.Thread(target=self._run, name="ckpt-digest", daemon=True)
        self._thread.start()

    def advance(self, written: int) -> None:
        """``written`` bytes of the file (from its start) are on disk. The thread is woken
        once a block's worth is waiting (not for every small item: each wake-up costs the
        writer a thread switch), and by :meth:`finish`."""
        with self._cond:
            self._written = max(self._written, written)
            if self._written - self._done >= _BLOCK:
                self._cond.notify()

    def _run(self) -> None:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        try:
            while True:
                with self._cond:
                    while self._written <= self._done and not self._closed:
                        self._cond.wait()
                    target, closed = self._written, self._closed
                if self._done >= target and closed:
                    return
                n = os.preadv(self._fd, [view[:min(_BLOCK, target - self._done)]], self._done)
                if n <= 0:
                    raise OSError(f"{self.path} is shorter than {target} bytes")
                if self._hash is not None:
                    self._hash.update(view[:n])
                else:
                    self._crc = crc32(view[:n], self._crc)
                self._done += n
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc

    def finish(self, size: int) -> tuple[int, str]:
        """Hash up to ``size`` (the file's final length), note the digest (:func:`note`) and
        return ``(size, hex digest)``."""
        self.advance(size)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        digest = self._hash.hexdigest() if self._hash is not None else \
            f"{self._crc & 0xFFFFFFFF:08x}"
        note(self.path, self.algorithm, size, digest)
        return size, digest

    def abandon(self) -> None:
        """Stop without a digest (the write failed)."""
        with self._cond:
            self._closed = True
            self._written = self._done
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)


class DigestedFile:
    """The file :func:`digested_file` opened: ``file`` (the binary stream), :meth:`write`
    (big buffers in slices the digest follows) and :meth:`advanced` (tell the digest what
    has reached the OS)."""

    def __init__(self, file: Any, follower: FollowingDigest | None,
                 writeback: Writeback | None = None):
        self.file = file
        self.follower = follower
        self.writeback = writeback
        self.position = 0  # bytes written through :meth:`write` (the file is new)
        self._told = 0

    def write(self, buf: Any) -> int:
        """Write ``buf`` (any buffer); returns its length."""
        view = memoryview(buf)
        if (self.follower is None and self.writeback is None) or view.nbytes <= _SLICE:
            n = self.file.write(view)
            self.position += view.nbytes
            return n
        for start in range(0, view.nbytes, _SLICE):
            self.file.write(view[start:start + _SLICE])
            self.position += min(_SLICE, view.nbytes - start)
            self.advanced()
        return view.nbytes

    def writev(self, buffers: Any) -> int:
        """Write ``buffers`` one after the other in one system call (the small ones are not
        copied into the stream's buffer first); returns their total length. Big ones go
        through :meth:`write` (in slices the digest follows)."""
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if total > _SLICE:
            for v in views:
                self.write(v)
            return total
        self.file.flush()  # what the stream holds goes first
        fd = self.file.fileno()
        while views:
            n = os.writev(fd, views)
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        self.position += total
        return total

    def advanced(self) -> None:
        """What the file holds so far (its OS position) may be hashed, and its write-back
        started (asked of the OS once a block more has been written: cheap to call after
        every small item)."""
        if (self.follower is not None or self.writeback is not None) \
                and self.position - self._told >= _BLOCK:
            self._told = os.lseek(self.file.fileno(), 0, os.SEEK_CUR)
            if self.follower is not None:
                self.follower.advance(self._told)
            if self.writeback is not None:
                self.writeback.wrote(self._told)


@contextlib.contextmanager
def digested_file(path: str | os.PathLike, algorithm: str | None, *,
                  sync: bool = True) -> Iterator[DigestedFile]:
    """A new file ``path`` written in the ``with`` block: flushed and (``sync``) fsynced at
    its end, with its write-back started as it grows (``ckpt_tool.writeback``), its
    ``algorithm`` digest (None: none) computed by a :class:`FollowingDigest` while it is
    written and noted once it is complete; on an error the digest is abandoned."""
    with open(path, "wb") as f:
        follower = FollowingDigest(path, algorithm) if algorithm else None
        try:
            yield DigestedFile(f, follower, Writeback(f.fileno()) if sync else None)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        except BaseException:
            if follower is not None:
                follower.abandon()
            raise
    if follower is not None:
        follower.finish(os.path.getsize(path))


def note(path: str | os.PathLike, algorithm: str, size: int, digest: str) -> None:
    """Remember the digest of the file ``path`` as it is now (its size and mtime)."""
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    if st.st_size == size:
        with _LOCK:
            _NOTED[path] = (algorithm, size, st.st_mtime_ns, digest)


def noted(path: str | os.PathLike, algorithm: str) -> tuple[int, str] | None:
    """``(size, digest)`` noted for ``path`` if the file is unchanged since, else None."""
    path = os.path.abspath(os.fspath(path))
    with _LOCK:
        entry = _NOTED.get(path)
    if entry is None or entry[0] != algorithm:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if (st.st_size, st.st_mtime_ns) != entry[1:3]:
        return None
    return entry[1], entry[3]


def take(root: str | os.PathLike) -> dict[str, Any]:
    """Remove and return the entries for files under the directory ``root`` (to hand them to
    the process that writes the manifest: :func:`give`)."""
    root = os.path.abspath(os.fspath(root)) + os.sep
    with _LOCK:
        mine = {p: e for p, e in _NOTED.items() if p.startswith(root)}
        for p in mine:
            del _NOTED[p]
    return mine


def give(entries: dict[str, Any]) -> None:
    """Add entries another process :func:`take` s (every rank's, on the one writing the
    manifest)."""
    with _LOCK:
        _NOTED.update(entries)
