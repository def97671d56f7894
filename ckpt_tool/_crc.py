"""CRC-32 (the zip polynomial) at memory speed: ISA-L's when ``isal`` is installed (about 5x
zlib's on one core), else the standard library's. Same values either way."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a declared dependency
    from zlib import crc32

__all__ = ["crc32"]
