"""Where a checkpoint lives: a local path, or a prefix of an S3-compatible object store.

Every path a user or a library caller gives goes through :func:`as_path`: a local path stays a
``pathlib.Path`` (and every local fast path -- ``open``, ``os.pread``, ``mmap`` -- stays as it
is); ``s3://bucket/prefix`` and Megatron-Core's ``msc://profile/path`` become an
:class:`~ckpt_tool.storage.object_path.ObjectPath`, which answers the part of the ``Path`` API
the readers use (``/``, ``name``, ``parent``, ``is_file``, ``is_dir``, ``iterdir``, ``glob``,
``stat``, ``read_bytes``, ``read_text``, ``open``) from listings and ranged GETs. The few
places that read bytes below that API (``mmap``, ``os.pread``) ask :func:`is_remote` and take
the ranged reads of :func:`read_range` / :func:`read_into` instead.

Nothing here imports the object-store client (``boto3``, the ``s3`` extra): local use loads
nothing new. ``docs/object-storage.md`` has the URLs, the credentials and the write protocol.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Union

__all__ = ["is_remote", "as_path", "AnyPath", "open_read", "read_range", "read_into",
           "file_size", "URL_SCHEMES"]

URL_SCHEMES = ("s3", "msc")
# pathlib collapses ``s3://b/k`` to ``s3:/b/k``: both spellings are URLs (Megatron-Core
# normalises ``msc:/`` the same way)
_PREFIXES = tuple(f"{s}:/" for s in URL_SCHEMES)

AnyPath = Union[Path, Any]  # a Path or an ObjectPath


def is_remote(path: Any) -> bool:
    """Whether ``path`` (a str, a Path, an ObjectPath) names an object-store location."""
    if isinstance(path, Path):
        s = path.as_posix()
    elif isinstance(path, str):
        s = path
    else:
        return getattr(path, "is_object_path", False)
    return s.startswith(_PREFIXES)


def as_path(path: str | os.PathLike | Any) -> AnyPath:
    """``path`` as a ``Path``, or an ``ObjectPath`` for an ``s3://`` / ``msc://`` URL (an
    ``msc://`` profile of the POSIX ``file`` kind gives the local ``Path`` it maps to)."""
    if getattr(path, "is_object_path", False):
        return path
    if is_remote(path):
        from ckpt_tool.storage.locations import resolve_url
        from ckpt_tool.storage.object_path import ObjectPath

        got = resolve_url(Path(path).as_posix() if isinstance(path, Path) else str(path))
        return got if isinstance(got, Path) else ObjectPath(*got)
    return Path(path)


def open_read(path: AnyPath) -> BinaryIO:
    """``open(path, "rb")`` for a local path; a seekable ranged reader for an object."""
    if getattr(path, "is_object_path", False):
        return path.open("rb")
    return open(path, "rb")


def file_size(path: AnyPath) -> int:
    """The size in bytes of the file or object ``path`` (OSError when absent)."""
    if getattr(path, "is_object_path", False):
        return path.stat().st_size
    return os.stat(path).st_size


def read_range(path: AnyPath, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of ``path`` (fewer when it is shorter)."""
    if getattr(path, "is_object_path", False):
        return path.read_range(offset, length)
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def read_into(path: AnyPath, offset: int, buf: Any) -> int:
    """Fill ``buf`` (a writable buffer) with the bytes of ``path`` from ``offset``; an object
    is fetched with parallel ranged GETs. Returns the bytes read (fewer: the file is short)."""
    if getattr(path, "is_object_path", False):
        return path.read_into(offset, buf)
    view = memoryview(buf).cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done
    finally:
        os.close(fd)
