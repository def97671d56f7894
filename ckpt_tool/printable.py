"""Text that every UTF-8 encoder accepts, for strings that may come from file names.

A Linux file name is bytes; those that are not UTF-8 reach Python as lone surrogates
(``os.fsdecode``'s ``surrogateescape``), which ``str.encode("utf-8")`` refuses. A path
written into a file's metadata (a safetensors header, a JSON index) or printed goes through
:func:`printable` first: such bytes then read ``\\xNN``, everything else is unchanged.
"""

from __future__ import annotations

import os

__all__ = ["printable", "is_printable"]


def printable(text: str | os.PathLike) -> str:
    """``text`` (or a path) with undecodable bytes as ``\\xNN`` and any other lone surrogate
    as ``\\udNNN``: valid Unicode, unchanged when it already is."""
    s = os.fspath(text)
    if isinstance(s, bytes):
        return s.decode("utf-8", "backslashreplace")
    if is_printable(s):
        return s
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") \
        if _escaped_bytes_only(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")


def is_printable(s: str) -> bool:
    """``s`` encodes as UTF-8 (no lone surrogates)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _escaped_bytes_only(s: str) -> bool:
    try:
        s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True
