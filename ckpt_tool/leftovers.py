"""What an interrupted write leaves beside its target, and the lock that keeps two runs from
writing one target at once.

Outputs are written into ``.<name>.ckpt-staging-*`` beside the target and renamed into place
(``ckpt_tool.ops._output_staging``). Replacing an existing target exchanges the two atomically where
the file system can; where it cannot, the old target is parked in ``.<name>.ckpt-old-*/old``
between two renames. A run killed with ``kill -9`` leaves those entries behind. They are
found here (``validate`` and ``inspect`` report them, also when the target itself does not
exist, and name a parked previous output with the command that restores it) and a rerun for
the same target reclaims them — safely, because every writer holds ``.<name>.ckpt-lock``
(``fcntl.flock``) while it works, so an entry is only reclaimed when no live run owns it. A
parked previous output whose target is missing is put back first, never deleted: only the
staging of the run that was killed is.

On an object store (``ckpt_tool.storage.writing``) the run marker ``.<name>.ckpt-writing``
plays the lock's and the staging's parts: what an unfinished write left is the marker and the
objects under ``<name>/`` (plus its open multipart uploads), reclaimed by the next run once
the marker's run is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator

from ckpt_tool._program import cleanup_on_stop
from ckpt_tool.errors import UsageError
from ckpt_tool.storage import as_path, is_remote

__all__ = ["STAGING_MARK", "OLD_MARK", "LOCK_SUFFIX", "PARKED_NAME", "side_prefix", "leftovers",
           "describe_leftovers", "parked_previous", "restore_command", "target_lock", "reclaim"]

STAGING_MARK = ".ckpt-staging-"
OLD_MARK = ".ckpt-old-"
LOCK_SUFFIX = ".ckpt-lock"
PARKED_NAME = "old"  # the previous output inside its ``.<name>.ckpt-old-*`` directory
_NAME_MAX = 255  # bytes in one file name (Linux, most file systems)
_RANDOM = 8  # what tempfile.mkdtemp appends


def side_prefix(out: Path, mark: str) -> str:
    """The name of what a write to ``out`` keeps beside it, up to its random part:
    ``.<name><mark>``. A name too long for that to fit in a file name (255 bytes) is cut and
    made unique again with a digest of the whole: ``.<first bytes>~<digest><mark>``."""
    import hashlib

    raw = os.fsencode(out.name)
    longest = max(len(STAGING_MARK), len(OLD_MARK), len(LOCK_SUFFIX)) + _RANDOM + 1
    if len(raw) + longest <= _NAME_MAX:
        return f".{out.name}{mark}"
    digest = hashlib.sha256(raw).hexdigest()[:10]
    keep = raw[:_NAME_MAX - longest - len(digest) - 1]
    return f".{os.fsdecode(keep)}~{digest}{mark}"


def leftovers(target: str | Path) -> list[Path]:
    """The staging / parked entries of writes to ``target`` found beside it (on an object
    store: the run marker, then the objects of the unfinished output)."""
    if is_remote(target):
        from ckpt_tool.storage.writing import remote_leftovers

        t = as_path(target)
        return remote_leftovers(t) if t.key else []
    out = Path(os.path.abspath(target))
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    heads = (side_prefix(out, STAGING_MARK), side_prefix(out, OLD_MARK))
    return sorted(out.parent / n for n in names if n.startswith(heads))


def parked_previous(target: str | Path) -> Path | None:
    """The previous output a run killed while replacing ``target`` parked beside it, when
    ``target`` itself is missing (the run died between its two renames): the most recently
    parked one; None when there is none or ``target`` exists."""
    out = Path(os.path.abspath(target))
    if os.path.lexists(out):
        return None
    parked = [p / PARKED_NAME for p in leftovers(out)
              if p.name.startswith(side_prefix(out, OLD_MARK))
              and os.path.lexists(p / PARKED_NAME)]
    if not parked:
        return None
    return max(parked, key=lambda p: (_mtime(p.parent), p.parent.name))


def restore_command(parked: Path, target: str | Path) -> str:
    """The shell command that puts ``parked`` back at ``target``."""
    import shlex

    return f"mv {shlex.quote(_shown(parked))} {shlex.quote(_shown(Path(target)))}"


def _shown(path: Path) -> str:
    """``path`` as a terminal can print it (undecodable bytes of a name as ``\\xNN``)."""
    from ckpt_tool.printable import printable

    return printable(os.path.abspath(path))


def _mtime(path: Path) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def describe_leftovers(found: list[Path]) -> str:
    """One phrase: what is left and how big, e.g. ``.x.ckpt-staging-ab12 (726.0 MiB)``."""
    if is_remote(found[0]):
        from ckpt_tool.storage.writing import describe_remote_leftovers

        return describe_remote_leftovers(found)
    sizes = [_size(p) for p in found]
    first = f"{found[0].name} ({sizes[0] / 2**20:.1f} MiB)"
    more = f" and {len(found) - 1} more ({sum(sizes[1:]) / 2**20:.1f} MiB)" if len(found) > 1 \
        else ""
    return first + more


@contextlib.contextmanager
def target_lock(target: str | Path) -> Iterator[None]:
    """Hold ``.<name>.ckpt-lock`` beside ``target`` for the duration (UsageError, exit 2, when
    another live run holds it). The file holds the owner's pid for people; the owner removes
    it when done (a killed owner's file is harmless: its lock died with it).

    The lock file is opened with ``O_NOFOLLOW`` and must be a regular file with one link: a
    symlink or hard link planted at its name never makes the run write (or truncate) the file
    it points at. A lock taken on a file another run removed meanwhile is taken again on the
    file now at the name (two runs never both hold a lock)."""
    out = Path(os.path.abspath(target))
    path = out.parent / side_prefix(out, LOCK_SUFFIX)
    while True:
        fd = _open_lock(path)
        try:
            if _flock(fd, path, out):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # the pid is for people; a full disk is reported
            os.ftruncate(fd, 0)               # by the write itself
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            with cleanup_on_stop(lambda: os.unlink(path)):
                yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)  # still holding the lock
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int:
    """The lock file, created if missing, never through a link (UsageError when what is at its
    name is not a plain file of its own)."""
    import stat

    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) \
        | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if os.path.islink(path) or exc.errno == errno.ELOOP:
            raise UsageError("a symlink is at the lock file's name: not ckpt's lock, so not "
                             "followed", path=path, hint="remove it, then rerun") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise UsageError("what is at the lock file's name is not a plain file of its own (a "
                         "hard link, a FIFO, a device): not ckpt's lock, so not written",
                         path=path, hint="remove it, then rerun")
    os.set_blocking(fd, True)
    return fd


def _flock(fd: int, path: Path, out: Path) -> bool:
    """Lock ``fd``: True when held on the file still at ``path``, False when that file was
    replaced meanwhile (retry), UsageError when another live run holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        who = f"another ckpt run (pid {owner})" if owner else "another ckpt run"
        raise UsageError(f"{who} is writing this output", path=out,
                         hint="wait for it to finish, or choose another output") from None
    try:
        st, now = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino)


def _owner(fd: int) -> str | None:
    """The pid the lock's holder wrote (it writes it just after taking the lock: a reader that
    comes in between waits a moment for it; None when it never shows)."""
    import time

    for _ in range(50):
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.01)
    return None


def reclaim(target: str | Path) -> tuple[str | None, bool]:
    """Put back a previous output parked beside a missing ``target``, then remove what
    interrupted writes left beside it (call with :func:`target_lock` held). Returns a note
    saying what was done (or None) and whether a previous output was put back."""
    out = Path(os.path.abspath(target))
    notes = []
    parked = parked_previous(out)
    if parked is not None:
        os.rename(parked, out)  # first: nothing of it is deleted below
        notes.append(f"restored the previous output {out.name} from {parked.parent.name} (a "
                     "run killed while replacing it had moved it aside)")
    found = leftovers(out)
    if found:
        notes.append(f"reclaimed what an interrupted run left beside the output: "
                     f"{describe_leftovers(found)}")
        for p in found:
            _remove(p)
    return ("; ".join(notes) or None), parked is not None


def _remove(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
