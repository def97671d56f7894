"""File digests computed while the file is written, for the integrity manifest
(``ckpt_tool.integrity_manifest``): the manifest then costs no second pass over the output.

:class:`FollowingDigest` runs a thread that reads a file behind its writer (``os.pread`` of
what the writer says is on disk: the page cache, 8 MiB at a time) and hashes it, so hashing
overlaps writing instead of following it; what it hashes is what the file holds. The writer
:func:`note` s the result; ``build_manifest`` uses a noted digest when the file still has
the size and modification time it had when noted (:func:`noted`), else reads the file.

The same thread also computes the CRC-32 of what the file holds, and :class:`DigestedFile`
the CRC-32 of the bytes its writer handed it (combined from the CRCs the writer computed of
its buffers anyway: no second pass). :func:`digested_file` compares the two once the file is
complete: a difference is an :class:`~ckpt_tool.errors.IntegrityError` (the write fails and
nothing is published); equal, the file is *proven* (:func:`proven_files`): it held exactly
the bytes written, as long as its size, modification time and inode are unchanged.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from typing import Any, Iterator

from ckpt_tool._crc import crc32, crc32_combine
from ckpt_tool.writeback import Writeback

__all__ = ["FollowingDigest", "DigestedFile", "digested_file", "note", "noted", "take", "give",
           "proven_files"]

_BLOCK = 8 << 20
_SLICE = 32 << 20  # big buffers are written in slices: the digest follows each
_LOCK = threading.Lock()
# absolute path -> (algorithm, size, mtime_ns, hex digest)
_NOTED: dict[str, tuple[str, int, int, str]] = {}
# absolute path -> (size, mtime_ns, ctime_ns, inode) when its bytes were proven
_PROVEN: dict[str, tuple[int, int, int, int]] = {}


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
                self._crc = crc32(view[:n], self._crc)  # (also for the writer's comparison)
                self._done += n
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc

    def finish(self, size: int, written_crc: int | None = None) -> tuple[int, str]:
        """Hash up to ``size`` (the file's final length), note the digest (:func:`note`) and
        return ``(size, hex digest)``. ``written_crc``: the CRC-32 of the bytes the writer
        wrote; the file's must equal it (else IntegrityError), and the file is then proven."""
        self.advance(size)
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        os.close(self._fd)
        if self._error is not None:
            raise self._error
        if written_crc is not None:
            held = self._crc & 0xFFFFFFFF
            if held != written_crc & 0xFFFFFFFF:
                from ckpt_tool.errors import IntegrityError

                raise IntegrityError(
                    f"{self.path}: the file does not hold the bytes written (CRC-32 of the "
                    f"file {held:08x}, of the bytes written {written_crc & 0xFFFFFFFF:08x})",
                    hint="the disk or another process changed the output while it was "
                    "written: nothing was published; check the disk and run again")
            _prove(self.path, size)
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
        # the CRC-32 of the bytes written through this object, in order (None once bytes
        # reached the file another way: see :meth:`bypassed`)
        self.crc: int | None = 0

    def write(self, buf: Any, crc: int | None = None) -> int:
        """Write ``buf`` (any buffer); returns its length. ``crc``: its CRC-32 if the caller
        has it (else computed here when the file is followed)."""
        view = memoryview(buf)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        self._account(view, crc)
        if (self.follower is None and self.writeback is None) or view.nbytes <= _SLICE:
            n = self.file.write(view)
            self.position += view.nbytes
            return n
        for start in range(0, view.nbytes, _SLICE):
            self.file.write(view[start:start + _SLICE])
            self.position += min(_SLICE, view.nbytes - start)
            self.advanced()
        return view.nbytes

    def writev(self, buffers: Any, crcs: Any = None) -> int:
        """Write ``buffers`` one after the other in one system call (the small ones are not
        copied into the stream's buffer first); returns their total length. Big ones go
        through :meth:`write` (in slices the digest follows). ``crcs``: their CRC-32s, if
        the caller has them."""
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(v.nbytes for v in views)
        if total > _SLICE:
            for n, v in enumerate(views):
                self.write(v, None if crcs is None else crcs[n])
            return total
        for n, v in enumerate(views):
            self._account(v, None if crcs is None else crcs[n])
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

    def _account(self, view: memoryview, crc: int | None) -> None:
        if self.follower is None or self.crc is None:
            return
        if crc is None:
            crc = crc32(view)
        self.crc = crc32_combine(self.crc, crc & 0xFFFFFFFF, view.nbytes)

    def bypassed(self) -> None:
        """Bytes reached the file without :meth:`write`/:meth:`writev` (e.g. a library
        writing into :attr:`file`): the file cannot be proven, only digested."""
        self.crc = None

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
            out = DigestedFile(f, follower, Writeback(f.fileno()) if sync else None)
            yield out
            f.flush()
            if sync:
                os.fsync(f.fileno())
        except BaseException:
            if follower is not None:
                follower.abandon()
            raise
    if follower is not None:
        size = os.path.getsize(path)
        written = out.crc if out.position == size else None
        follower.finish(size, written)


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
        for p in [p for p in _PROVEN if p.startswith(root)]:
            del _PROVEN[p]
    return mine


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _prove(path: str, size: int) -> None:
    st = os.stat(path)
    if st.st_size == size:
        with _LOCK:
            _PROVEN[path] = _identity(st)


def proven_files(root: str | os.PathLike) -> set[str]:
    """The files under the directory ``root`` (paths relative to it, ``/``-separated) whose
    bytes this process proved equal to those written (see the module docstring) and which
    are unchanged since: same size, modification and change time, inode."""
    base = os.path.abspath(os.fspath(root)) + os.sep
    with _LOCK:
        mine = {p: e for p, e in _PROVEN.items() if p.startswith(base)}
    out = set()
    for p, ident in mine.items():
        try:
            if _identity(os.stat(p)) == ident:
                out.add(p[len(base):].replace(os.sep, "/"))
        except OSError:
            pass
    return out


def give(entries: dict[str, Any]) -> None:
    """Add entries another process :func:`take` s (every rank's, on the one writing the
    manifest)."""
    with _LOCK:
        _NOTED.update(entries)
