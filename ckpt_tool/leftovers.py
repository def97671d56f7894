"""What an interrupted write leaves beside its target, and the lock that keeps two runs from
writing one target at once.

Outputs are written into ``.<name>.ckpt-staging-*`` beside the target and renamed into place
(``ckpt_tool.ops._staging``); replacing an existing target parks it in ``.<name>.ckpt-old-*``
for a moment. A run killed with ``kill -9`` leaves those entries behind. They are found here
(``validate`` and ``inspect`` report them, also when the target itself does not exist) and a
rerun for the same target reclaims them — safely, because every writer holds
``.<name>.ckpt-lock`` (``fcntl.flock``) while it works, so an entry is only reclaimed when no
live run owns it.

On an object store (``ckpt_tool.storage.writing``) the run marker
``.<name>.ckpt-writing`` plays both parts: what an unfinished write left is the marker and the
objects under ``<name>/`` (plus its open multipart uploads), reclaimed by the next run once
the marker's run is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from ckpt_tool.errors import UsageError
from ckpt_tool.storage import as_path, is_remote

__all__ = ["STAGING_MARK", "OLD_MARK", "LOCK_SUFFIX", "leftovers", "describe_leftovers",
           "target_lock", "reclaim"]

STAGING_MARK = ".ckpt-staging-"
OLD_MARK = ".ckpt-old-"
LOCK_SUFFIX = ".ckpt-lock"


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
    heads = (f".{out.name}{STAGING_MARK}", f".{out.name}{OLD_MARK}")
    return sorted(out.parent / n for n in names if n.startswith(heads))


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
    it when done (a killed owner's file is harmless: its lock died with it)."""
    import fcntl

    out = Path(os.path.abspath(target))
    path = out.parent / f".{out.name}{LOCK_SUFFIX}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise UsageError(f"another ckpt run (pid {owner}) is writing this output", path=out,
                             hint="wait for it to finish, or choose another output") from None
        with contextlib.suppress(OSError):  # the pid is for people; a full disk is reported
            os.ftruncate(fd, 0)               # by the write itself
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)  # still holding the lock
    finally:
        os.close(fd)  # releases the lock


def reclaim(target: str | Path) -> str | None:
    """Remove what interrupted writes left beside ``target`` (call with :func:`target_lock`
    held); returns a note saying what was reclaimed, or None."""
    found = leftovers(target)
    if not found:
        return None
    what = describe_leftovers(found)
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return f"reclaimed what an interrupted run left beside the output: {what}"
