"""Byte-level tools the bad-input corpus uses to damage COPIES of real checkpoints: truncate,
flip zip record fields, rewrite DCP ``.metadata`` and safetensors headers, craft pickles that
would run code. Nothing here touches ``fixtures/``: every function gets a path inside a copy."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

# zip record fields: offset inside the record (APPNOTE.TXT 4.3.7, 4.3.12, 4.3.14-16)
CDIR = {"signature": 0, "made by": 4, "version needed": 6, "flags": 8, "method": 10,
        "crc": 16, "compressed size": 20, "size": 24, "name length": 28, "extra length": 30,
        "comment length": 32, "disk": 34, "local header offset": 42}
LOCAL = {"signature": 0, "version needed": 4, "flags": 6, "method": 8, "crc": 14,
         "compressed size": 18, "size": 22, "name length": 26, "extra length": 28}
# relative to the end-of-central-directory record (zip64 locator 20 bytes and record 56 before)
END = {"end record: disk": 4, "end record: directory disk": 6, "end record: entries": 10,
       "end record: directory size": 12, "end record: directory offset": 16,
       "end record: comment length": 20,
       "zip64 locator: signature": -20, "zip64 locator: disks": -20 + 16,
       "zip64 record: signature": -76, "zip64 record: disk": -76 + 16,
       "zip64 record: entries": -76 + 32, "zip64 record: directory size": -76 + 40,
       "zip64 record: directory offset": -76 + 48}


class Reduce:
    """Pickles as ``func(*args)``: unpickling it runs ``func``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def evil(marker: Path):
    """An object whose unpickling creates ``marker`` (nothing else)."""
    return Reduce(os.system, f"touch {marker}")


def truncate(path: Path, keep: int | float) -> None:
    """Keep ``keep`` bytes (an int; negative counts from the end) or that fraction."""
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0
                                                                else len(data) + keep)
    path.write_bytes(data[:n])


def patch(path: Path, at: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + len(new)] = new
    path.write_bytes(bytes(data))


def xor(path: Path, at: int, mask: int = 1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def replace_first(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert old in data, (path, old)
    path.write_bytes(data.replace(old, new, 1))


def zip_field_at(blob: bytes, family: str, field: str, entry: int = 0) -> int:
    """Offset of a zip structure field inside ``blob`` (one archive)."""
    if family == "end":
        return blob.rfind(b"PK\x05\x06") + END[field]
    sig, table = (b"PK\x01\x02", CDIR) if family == "central" else (b"PK\x03\x04", LOCAL)
    starts = [i for i in range(len(blob) - 3) if blob[i:i + 4] == sig]
    return starts[entry] + table[field]


def rewrite_zip_member(path: Path, member_suffix: str, fn) -> None:
    """Rewrite one member of a torch.save zip with ``fn(bytes) -> bytes`` (stored, aligned
    like torch's own writer is not needed by its reader)."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(member_suffix):
                data = fn(data)
            dst.writestr(info.filename, data)
    path.write_bytes(out.getvalue())


# -- DCP .metadata ----------------------------------------------------------------------------

def read_dcp_metadata(ck: Path):
    """The real torch reader (plain pickle: only ever used on our pristine copies)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(ck)).read_metadata()


def write_dcp_metadata(ck: Path, md) -> None:
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def storage_of(md, fqn: str):
    """(MetadataIndex, _StorageInfo) of the first stored item of ``fqn``."""
    for idx, info in md.storage_data.items():
        if idx.fqn == fqn:
            return idx, info
    raise KeyError(fqn)


def item_blob(ck: Path, fqn: str) -> tuple[Path, int, int]:
    """File, offset and length of a DCP item (from the pristine metadata)."""
    _, info = storage_of(read_dcp_metadata(ck), fqn)
    return ck / info.relative_path, info.offset, info.length


def flip_item_field(ck: Path, fqn: str, family: str, field: str, entry: int = 0,
                    mask: int = 1) -> None:
    path, off, length = item_blob(ck, fqn)
    blob = path.read_bytes()[off:off + length]
    xor(path, off + zip_field_at(blob, family, field, entry), mask)


def append_item(ck: Path, fqn: str, payload: bytes) -> None:
    """Append ``payload`` to the item's data file and point ``fqn``'s storage at it."""
    import dataclasses

    md = read_dcp_metadata(ck)
    idx, info = storage_of(md, fqn)
    path = ck / info.relative_path
    start = path.stat().st_size
    with open(path, "ab") as f:
        f.write(payload)
    md.storage_data[idx] = dataclasses.replace(info, offset=start, length=len(payload))
    write_dcp_metadata(ck, md)


def torch_save_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- safetensors ------------------------------------------------------------------------------

def read_st(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_st(path: Path, header, body: bytes, raw_header: bytes | None = None,
             length: int | None = None) -> None:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + body)


def edit_st(path: Path, fn) -> None:
    header, body = read_st(path)
    fn(header)
    write_st(path, header, body)


# -- integrity: damage that the zip CRC-32s or the items themselves reveal -----------------------

def record_start(blob: bytes, name_part: str) -> int:
    """Where the data of the first record whose name contains ``name_part`` starts in the
    archive ``blob`` (its local header read as every zip reader does)."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist()
                if name_part in i.filename)
    n, e = struct.unpack_from("<HH", blob, info.header_offset + 26)
    return info.header_offset + 30 + n + e


def flip_item_data(ck: Path, fqn: str, at: int = 5, mask: int = 0x10,
                   record: str = "/data/") -> None:
    """Flip one byte of a DCP item's record (by default its tensor's data): the record's
    CRC-32 no longer matches, nothing else changes."""
    path, off, length = item_blob(ck, fqn)
    blob = path.read_bytes()[off:off + length]
    xor(path, off + record_start(blob, record) + at, mask)


def flip_record_data(path: Path, record: str = "/data/", at: int = 5, mask: int = 0x10) -> None:
    """The same in a whole ``torch.save`` file (a legacy rank file, a torch.save file)."""
    xor(path, record_start(path.read_bytes(), record) + at, mask)


# -- the oldest torch.save form: a tar archive ---------------------------------------------------

def tar_torch_save(link_target: str) -> bytes:
    """A torch.save file in its tar form (``storages``, ``tensors``, ``pickle``, ``sys_info``
    members, as PyTorch < 0.4 wrote it and ``torch.load`` still reads it) whose ``storages``
    member is a symlink to ``link_target``: ``torch.load`` extracts it and opens the target."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("storages")
        link.type, link.linkname = tarfile.SYMTYPE, link_target
        tar.addfile(link)
        for name, obj in (("tensors", 0), ("pickle", {"args": None}), ("sys_info", {})):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# -- pickles no torch.save writes: deep, self-referential --------------------------------------

def deep_list_pickle(depth: int) -> bytes:
    """A protocol-2 pickle of ``{"args": [[[...]]]}`` nested ``depth`` lists deep, built as
    the unpickler builds it (no recursion): ``depth`` empty lists, each appended to the one
    before."""
    body = b"]" * depth + b"a" * (depth - 1)
    return b"\x80\x02}X\x04\x00\x00\x00args" + body + b"s."


def self_referential_pickle() -> bytes:
    """``{"args": l}`` where ``l`` is a list holding itself (a memo reference)."""
    return b"\x80\x02}X\x04\x00\x00\x00args]q\x00h\x00as."


def deflate_zip(path: Path) -> None:
    """Rewrite a torch.save zip with every record deflate-compressed (``torch.load`` reads
    it: miniz inflates)."""
    src = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    path.write_bytes(out.getvalue())


def with_megatron_object(data_pkl: bytes, state: dict) -> bytes:
    """``data_pkl`` (a pickled dict) with one more entry, ``"obj"``: an instance of a real
    Megatron-Core class (``TransformerConfig``, created empty and given ``state``, as pickle
    does for any object)."""
    obj = (b"cmegatron.core.transformer.transformer_config\nTransformerConfig\n)\x81"
           + pickle.dumps(state, protocol=2)[2:-1] + b"b")
    assert data_pkl.endswith(b".")
    return data_pkl[:-1] + b"X\x03\x00\x00\x00obj" + obj + b"s."


def allocating_pickle(n: int) -> bytes:
    """``{"args": bytearray(n)}`` as a pickle (a few dozen bytes asking for ``n``)."""
    return (b"\x80\x02}X\x04\x00\x00\x00argsc__builtin__\nbytearray\nJ"
            + n.to_bytes(4, "little", signed=True) + b"\x85Rs.")
