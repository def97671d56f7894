"""A checkpoint is made of regular files and directories: find what is not, before anything
is read.

Opening a FIFO for reading waits for a writer that may never come, and reading a character
device (``/dev/zero``) or a socket may never end. Such an entry where a checkpoint's file
belongs (placed there, or a symlink to one) is refused with one error naming it, before any
command reads a byte or creates its output's lock or staging directory: :func:`detect`
(``formats.base``) checks the checkpoint's whole tree (:func:`check_tree`) and the files that
locate it (the tracker, a manifest beside a single file), and :func:`open_regular` opens a
file without blocking and refuses it if it is not regular (for the few files read before
the tree is known). A file that a checkpoint's own metadata names stays inside it
(:func:`inside_name`).

An object store holds nothing but objects (``ckpt_tool.storage``): its locations pass these
checks untouched.

Reads of regular files are not bounded by a timeout: a file system that stops answering (a
hard NFS mount) blocks the kernel call itself, which no process can bound; the process can
still be killed, and what it leaves is reclaimed (``ckpt_tool.leftovers``).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.storage import is_remote

__all__ = ["check_tree", "check_regular", "open_regular", "kind_of", "inside_name", "MAX_DEPTH"]

MAX_DEPTH = 4  # a checkpoint's deepest files: iter_*/mp_rank_*/file, zarr array/chunk


def kind_of(mode: int) -> str | None:
    """What a file of ``mode`` is, when it is neither a regular file nor a directory."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "not a regular file"


def _refuse(path: str | Path, kind: str) -> InputError:
    return InputError(f"{kind}, not a regular file: reading it could block forever",
                      path=path, hint="a checkpoint holds regular files only: replace or "
                      "remove it")


def check_regular(path: str | Path) -> None:
    """InputError when ``path`` (followed if a symlink) exists and is neither a regular file
    nor a directory; nothing when it is one, or cannot be stat'ed (the read reports that)."""
    if is_remote(path):
        return
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    kind = kind_of(mode)
    if kind is not None:
        raise _refuse(path, kind)


def check_tree(root: str | Path, depth: int = MAX_DEPTH, *, _inside: str | None = None
               ) -> None:
    """InputError naming the first entry under the directory ``root`` (``depth`` levels down)
    that is neither a regular file nor a directory (a symlink judged by what it resolves
    to), or a symlink to a file outside the checkpoint (``root`` resolved first, so the root
    itself may be a link; a Hugging Face cache snapshot, ``snapshots/<rev>``, holds links
    into its repository's ``blobs/``: the repository directory is the checkpoint's).
    A symlink to a directory is not descended: nothing a checkpoint references lies behind
    one (a stray ``rootfs -> /`` must not make the scan walk ``/dev``). Entries that cannot
    be stat'ed (broken links, loops, no permission) are left to the reads that report them."""
    if is_remote(root):
        return
    if _inside is None:
        _inside = _container_of(os.path.realpath(root))
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir():  # follows a symlink (its d_type: no system call otherwise)
                if depth > 1 and not entry.is_symlink():
                    check_tree(entry.path, depth - 1, _inside=_inside)
                continue
            if entry.is_symlink() and entry.is_file():
                target = os.path.realpath(entry.path)
                if os.path.commonpath([target, _inside]) != _inside:
                    raise InputError(
                        f"a symlink to {target}, outside the checkpoint: not followed",
                        path=entry.path, hint="a checkpoint's files lie inside its directory: "
                        "copy the file in, or point the command at the directory holding both")
            if entry.is_file():
                continue
            mode = entry.stat().st_mode
        except OSError:
            continue
        kind = kind_of(mode)
        if kind is not None:
            raise _refuse(entry.path, kind)


def _container_of(real_root: str) -> str:
    """The directory a checkpoint's files may link into: the checkpoint's own, or for a
    Hugging Face cache snapshot (``<repo>/snapshots/<rev>``) its repository directory."""
    parent = os.path.dirname(real_root)
    if os.path.basename(parent) == "snapshots":
        return os.path.dirname(parent)
    return real_root


def open_regular(path: str | Path) -> BinaryIO:
    """``open(path, "rb")`` that never blocks in the open and refuses (InputError) anything
    but a regular file; OSErrors of the open as ``open`` raises them."""
    if is_remote(path):
        from ckpt_tool.storage import as_path

        return as_path(path).open("rb")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        kind = kind_of(mode)
        if kind is not None:
            raise _refuse(path, kind)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def inside_name(name: Any, what: str, source: str) -> str:
    """``name`` (a file named by a checkpoint's own metadata: a DCP storage ``relative_path``,
    a safetensors index's ``weight_map`` value) checked to stay inside the checkpoint: a
    non-empty relative path without ``..``. An absolute path or ``../x`` would make a reader
    open (or a writer replace) a file outside the checkpoint: CorruptCheckpointError naming
    ``what`` and the ``source`` that says so."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CorruptCheckpointError(f"{what} {name!r} is not a file name",
                                     hint=f"{source} is damaged")
    if os.path.isabs(name) or name.startswith(("/", "\\")) \
            or ".." in name.replace("\\", "/").split("/"):
        raise CorruptCheckpointError(
            f"{what} {name!r} is outside the checkpoint directory",
            hint=f"{source} is damaged or crafted; nothing outside the checkpoint is read")
    return name
