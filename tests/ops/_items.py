"""Editing DCP items in place the way a writer would: values changed, CRC-32s kept right.

``ckpt`` refuses an item whose record no longer matches its CRC-32 (damage is never read,
copied or compared); a test that wants an intact item holding other values rewrites the
CRC-32 of every record of the item, in its local header and its central directory entry."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from pathlib import Path


def refresh_crcs(path: Path, offset: int, length: int) -> None:
    """Rewrite the CRC-32 of every record of the torch.save item at ``[offset, offset +
    length)`` of ``path`` to match its data."""
    data = bytearray(path.read_bytes())
    item = bytes(data[offset:offset + length])
    zf = zipfile.ZipFile(io.BytesIO(item))
    pos = zf.start_dir
    for info in zf.infolist():
        n, m = struct.unpack_from("<HH", item, info.header_offset + 26)
        start = info.header_offset + 30 + n + m
        crc = struct.pack("<L", zlib.crc32(item[start:start + info.file_size]))
        data[offset + info.header_offset + 14:offset + info.header_offset + 18] = crc
        data[offset + pos + 16:offset + pos + 20] = crc
        n, m, k = struct.unpack_from("<HHH", item, pos + 28)
        pos += 46 + n + m + k
    path.write_bytes(bytes(data))
