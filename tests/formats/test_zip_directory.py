"""The zip structure checks against PyTorch's own reader, systematically: every byte of every
zip structure of a ``torch.save`` archive (each local header, the central directory, the
ZIP64 end record and locator, the end record), flipped with several masks, and every
condition ``torch.load`` applies is found by ``formats.containers.torch_zip.zip_directory``:

* whatever ``torch.load`` refuses, the raw path never reads in place: the structure checks
  and CRC-32s (``archive_check.check_archive``) or the tensor's lookup (``torch_zip_read.raw_item``)
  refuse it, or send it to ``torch.load`` (``NotSimple``), whose error is then the verdict;
* whatever the fast checks call a PyTorch refusal (``TorchRejects``), ``torch.load`` does
  refuse (the messages' "torch.load refuses it" is true), but for X2 (a record marked as a
  directory, which torch reads as no bytes: accepted, and silently wrong).
"""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from ckpt_tool.errors import CorruptCheckpointError
from ckpt_tool.formats.containers.torch_zip.archive_check import check_archive
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import raw_item
from ckpt_tool.formats.containers.torch_zip.zip_directory import (NotSimple, TorchRejects,
                                                                  zip_records)

MASKS = (0x01, 0x02, 0x10, 0x80, 0xFF)


def _archive() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(48, dtype=torch.float32).reshape(6, 8), buf)  # a DCP item
    return buf.getvalue()


def _structure_bytes(blob: bytes) -> list[int]:
    """Offsets of every byte of the archive's zip structures (not the records' data)."""
    zf = zipfile.ZipFile(io.BytesIO(blob))
    out: list[int] = []
    for info in zf.infolist():
        n, m = struct.unpack_from("<HH", blob, info.header_offset + 26)
        out += range(info.header_offset, info.header_offset + 30 + n + m)
    out += range(zf.start_dir, len(blob))  # central directory, ZIP64 records, end record
    return out


def _torch_loads(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - any failure is torch's verdict
        return False


BLOB = _archive()
CASES = [(at, mask) for at in _structure_bytes(BLOB) for mask in MASKS]


def _read_in_place(data: bytes) -> bool:
    """Whether the raw path reads the archive's tensor (never through ``torch.load``): its
    records pass the structure checks and their CRC-32s, and the tensor is found in place.
    (NotSimple sends a read to ``torch.load``, whose verdict is then the one given.)"""
    try:
        raw_item(data, check_archive(data, "item"))
        return True
    except (CorruptCheckpointError, NotSimple):  # (IntegrityError: a CRC-32 mismatch)
        return False


def test_the_intact_archive_passes():
    assert _torch_loads(BLOB)
    assert [r.name for r in check_archive(BLOB, "item")][0] == "archive/data.pkl"


def test_every_structure_byte_against_torch_load():
    missed, false_claims = [], []
    for at, mask in CASES:
        data = bytearray(BLOB)
        data[at] ^= mask
        data = bytes(data)
        torch_ok = _torch_loads(data)
        if not torch_ok and _read_in_place(data):
            missed.append((at, mask))
        try:
            raw_item(data)
        except TorchRejects as exc:
            if torch_ok and not str(exc).startswith("X2"):
                false_claims.append((at, mask, str(exc)))
        except NotSimple:  # zipfile or torch.load decides
            pass
    assert not missed, f"torch.load refuses, the checks pass: {missed[:20]}"
    assert not false_claims, f"said torch refuses, it does not: {false_claims[:20]}"


@pytest.mark.parametrize("field,at,value", [
    ("C5: disk number start 2", 34, 2), ("C5: disk number start 0xFFFF", 34, 0xFFFF),
    ("C7: masked local header", 8, 0x2000), ("X3: encrypted", 8, 0x1),
    ("X4: method 12", 10, 12)])
def test_each_central_directory_condition(field, at, value):
    """Each condition on a central directory entry, on the tensor's storage record: refused
    by torch.load, by the fast checks under its id."""
    blob = bytearray(BLOB)
    zf = zipfile.ZipFile(io.BytesIO(BLOB))
    pos = zf.start_dir
    for info in zf.infolist():
        if info.filename.endswith("/data/0"):
            break
        n, m, k = struct.unpack_from("<HHH", BLOB, pos + 28)
        pos += 46 + n + m + k
    struct.pack_into("<H", blob, pos + at, value)
    assert not _torch_loads(bytes(blob))
    with pytest.raises(TorchRejects, match=field.split(":")[0]):
        zip_records(bytes(blob))
