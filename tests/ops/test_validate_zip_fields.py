"""Every end-of-archive field PyTorch's zip reader relies on, flipped in one ``.distcp`` item
of a checkpoint the real Megatron-Core wrote: ``ckpt validate`` (with and without ``--deep``)
gives an error exactly when ``torch.load`` of that item fails, and stays quiet when torch does
not care (it reads the ZIP64 records and ignores the 32-bit ones they stand for)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.ops.validate import validate

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
# (name, where from the end-of-central-directory record, xor)
_EOCD, _LOC, _Z64 = 0, -20, -20 - 56
FIELDS = [
    ("zip64 record: disk number", _Z64 + 16, 1), ("zip64 record: directory disk", _Z64 + 20, 1),
    ("zip64 record: entries on this disk", _Z64 + 24, 1),
    ("zip64 record: entries in total", _Z64 + 32, 1),
    ("zip64 record: directory size", _Z64 + 40, 1),
    ("zip64 record: directory offset", _Z64 + 48, 1),
    ("zip64 record: signature", _Z64, 1), ("zip64 locator: disk count", _LOC + 16, 1),
    ("zip64 locator: signature", _LOC, 1), ("zip64 locator: record's disk", _LOC + 4, 1),
    ("end record: disk number", _EOCD + 4, 1), ("end record: directory disk", _EOCD + 6, 1),
    ("end record: entries on this disk", _EOCD + 8, 1),
    ("end record: entries", _EOCD + 10, 1), ("end record: directory size", _EOCD + 12, 1),
    ("end record: directory offset", _EOCD + 16, 1),
]


def _item(root: Path) -> tuple[Path, int, int]:
    chunk = open_checkpoint(root).metadata().tensors["output_layer.weight"].chunks[0]
    return root / "iter_0000010" / chunk.file, chunk.byte_offset, chunk.byte_length


def _torch_loads(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), weights_only=True)
        return True
    except Exception:  # noqa: BLE001 - any failure is torch's verdict
        return False


@pytest.mark.parametrize("name,where,xor", FIELDS, ids=[f[0] for f in FIELDS])
def test_validate_agrees_with_torch_load(tmp_path, name, where, xor):
    root = tmp_path / "ckpt"
    shutil.copytree(FIX, root)
    path, offset, length = _item(root)
    data = bytearray(path.read_bytes())
    eocd = offset + length - 22
    assert data[eocd:eocd + 4] == b"PK\x05\x06"
    data[eocd + where] ^= xor
    path.write_bytes(bytes(data))
    torch_ok = _torch_loads(bytes(data[offset:offset + length]))
    for deep in (False, True):
        findings = validate(root, deep=deep).findings
        errors = [f for f in findings if f.severity == "error"]
        assert (not errors) == torch_ok, (name, deep, torch_ok, [f.message for f in errors])
        if errors:
            assert any("torch" in f.message or "archive" in f.message for f in errors)


def test_torch_rejects_what_the_issue_found():
    """The ZIP64 disk-number flip of the issue: torch.load fails on it (so must validate)."""
    path, offset, length = _item(FIX)
    data = bytearray(path.read_bytes()[offset:offset + length])
    data[len(data) - 22 + _Z64 + 16] ^= 1
    assert not _torch_loads(bytes(data))


_CDIR = {"signature": 0, "made by": 4, "version needed": 6, "flags": 8, "method": 10,
         "time": 12, "date": 14, "crc": 16, "compressed size": 20, "size": 24,
         "name length": 28, "extra length": 30, "comment length": 32, "disk": 34,
         "internal attributes": 36, "external attributes": 38, "local header offset": 42,
         "name": 46}
_LOCAL = {"signature": 0, "version needed": 4, "flags": 6, "method": 8, "time": 10, "crc": 14,
          "compressed size": 18, "size": 22, "name length": 26, "extra length": 28, "name": 30}
# Where validate is stricter than torch.load, on purpose: a CRC that does not match the data,
# and local-header name/extra lengths that move where the data starts (torch then reads
# shifted bytes without noticing).
_STRICTER = {("central", "crc"), ("local", "name length"), ("local", "extra length")}


def _entries(raw: bytes) -> list[tuple[int, int]]:
    cds = [i for i in range(len(raw) - 3) if raw[i:i + 4] == b"PK\x01\x02"]
    lhs = [i for i in range(len(raw) - 3) if raw[i:i + 4] == b"PK\x03\x04"]
    return list(zip(cds, lhs))


CASES = [(e, fam, name) for e in range(7)
         for fam, fields in (("central", _CDIR), ("local", _LOCAL)) for name in fields]


@pytest.mark.parametrize("entry,family,field", CASES,
                         ids=[f"entry{e}-{fam}-{f.replace(' ', '_')}" for e, fam, f in CASES])
def test_every_record_header_field(tmp_path, entry, family, field):
    """Each field of each record's central-directory entry and local header: whatever
    torch.load refuses is an error; an error where torch.load does not fail is one of the
    deliberate stricter checks."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIX, root)
    path, offset, length = _item(root)
    data = bytearray(path.read_bytes())
    raw = bytes(data[offset:offset + length])
    entries = _entries(raw)
    assert len(entries) == 7
    base = entries[entry][0 if family == "central" else 1]
    at = base + (_CDIR if family == "central" else _LOCAL)[field]
    data[offset + at] ^= 1
    path.write_bytes(bytes(data))
    torch_ok = _torch_loads(bytes(data[offset:offset + length]))
    for deep in (False, True):
        errors = [f for f in validate(root, deep=deep).findings if f.severity == "error"]
        if not torch_ok:
            assert errors, (entry, family, field, deep)
        elif errors:
            assert (family, field) in _STRICTER, (entry, family, field, deep,
                                                  [f.message for f in errors])
