"""``validate``'s one-pass scan: CRC32 of legacy rank files' zip records, and ``--deep`` NaN/Inf
counts taken in place (DCP items and legacy raw chunks) agreeing with reads through the
reader."""

import shutil
import struct
import zlib
from pathlib import Path

import pytest
import torch

import ckpt_tool.ops.validate._integrity_pass as integrity
from ckpt_tool.formats import detect
from ckpt_tool.formats.containers.torch_zip.zip_directory import zip_records
from ckpt_tool.ops.validate._checks import nonfinite
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.ops.validate import validate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
LEGACY = FIXTURES / "megatron_legacy_tp2pp2"


@pytest.fixture
def legacy(tmp_path):
    return Path(shutil.copytree(LEGACY, tmp_path / "legacy")) / "iter_0000010"


def _chunk(root, key_part):
    meta = inspect(root).meta
    key = next(k for k in sorted(meta.tensors) if key_part in k)
    return key, meta.tensors[key].chunks[0]


def _record_of(blob, offset):
    return next(r for r in zip_records(blob) if r.start <= offset < r.start + r.size)


def _set_crc(blob: bytearray, name: str, crc: int) -> None:
    """Write ``crc`` for record ``name`` into its central directory entry and local header."""
    count, cd_off = struct.unpack_from("<H", blob, len(blob) - 12)[0], \
        struct.unpack_from("<L", blob, len(blob) - 6)[0]
    pos = cd_off
    for _ in range(count):
        nlen, elen, clen = struct.unpack_from("<3H", blob, pos + 28)
        if blob[pos + 46:pos + 46 + nlen].decode() == name:
            struct.pack_into("<L", blob, pos + 16, crc)
            lho = struct.unpack_from("<L", blob, pos + 42)[0]
            struct.pack_into("<L", blob, lho + 14, crc)
            return
        pos += 46 + nlen + elen + clen
    raise AssertionError(name)


def _poke(path: Path, offset: int, data: bytes, *, fix_crc: bool) -> str:
    blob = bytearray(path.read_bytes())
    blob[offset:offset + len(data)] = data
    rec = _record_of(bytes(blob), offset)
    if fix_crc:
        _set_crc(blob, rec.name, zlib.crc32(blob[rec.start:rec.start + rec.size]))
    path.write_bytes(bytes(blob))
    return rec.name


def test_legacy_fixture_is_clean_and_every_rank_file_is_crc_checked(split):
    r = validate(LEGACY, deep=True)
    assert r.ok and r.findings == []
    assert r.stats["zip_items_checked"] == 4 and r.stats["tensors_read"] == r.stats["tensors"]
    meta = inspect(LEGACY).meta
    sizes = {f: (Path(meta.root) / f).stat().st_size for f in meta.extras["rank_files"]}
    units = integrity._plan(Path(meta.root), meta, sizes, set(), True)
    assert (len(units) > 4) == (split == "records_split_over_threads")


@pytest.fixture(params=["one_unit_per_file", "records_split_over_threads"])
def split(request, monkeypatch):
    if request.param == "records_split_over_threads":
        monkeypatch.setattr(integrity, "_UNIT_BYTES", 1 << 10)
        monkeypatch.setattr(integrity, "_workers", lambda: 4)
    return request.param


def test_legacy_flipped_byte_in_a_tensor_record_is_an_error(legacy, split):
    key, c = _chunk(legacy, "linear_fc2.weight")
    path = legacy / c.file
    blob = path.read_bytes()
    name = _poke(path, c.byte_offset + 5, bytes([blob[c.byte_offset + 5] ^ 0x10]),
                 fix_crc=False)
    r = validate(legacy)
    assert len(r.errors) == 1, r.findings
    f = r.errors[0]
    assert f.file == c.file and f.key == key
    assert name in f.message and "CRC" in f.message
    assert validate(legacy, deep=True).stats["tensors_read"] < r.stats["tensors"]


def test_legacy_deep_counts_nan_in_place_like_the_reader(legacy, split):
    key, c = _chunk(legacy, "linear_qkv.weight")
    nan = struct.pack("<f", float("nan")) if "float32" in inspect(legacy).meta.tensors[
        key].dtype else b"\xc0\x7f"
    _poke(legacy / c.file, c.byte_offset + 2 * len(nan), nan, fix_crc=True)
    r = validate(legacy, deep=True)
    assert r.ok and [f.key for f in r.findings] == [key]
    assert r.findings[0].message.startswith("1 NaN and 0 Inf")
    meta = inspect(legacy).meta  # counted in place, by the scan ...
    sizes = {f: (legacy / f).stat().st_size
             for f in {c.file for t in meta.tensors.values() for c in t.chunks}}
    _, counted = integrity.scan_archives(legacy, meta, sizes, {}, set(), deep=True)
    assert counted[key] == (1, 0) and set(counted) == set(meta.tensors)
    reader = detect(legacy).open(legacy)  # ... like the reader path (what deep did before)
    try:
        assert nonfinite(reader.read(key)) == (1, 0)
    finally:
        reader.close()


def test_dcp_deep_in_place_big_bf16_and_misaligned(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp_api

    big = torch.randn(300, 700).bfloat16()  # > _SMALL: counted slab by slab
    big[17, 3] = float("nan")
    big[299, 699] = float("inf")
    odd = torch.randn(13, 5)  # small, lands at an odd offset of the file
    odd[0, 0] = -float("inf")
    half = torch.full((1000,), 60000.0, dtype=torch.float16)  # sums overflow, still finite
    dcp_api.save({"big": big, "odd": odd, "half": half, "n": torch.arange(3)},
                 checkpoint_id=tmp_path / "ck", no_dist=True)
    monkeypatch.setattr(integrity, "_SLAB", 4096)
    r = validate(tmp_path / "ck", deep=True)
    assert r.ok and r.stats["tensors_read"] == 4
    got = {f.key: f.message for f in r.findings}
    assert got == {"big": "1 NaN and 1 Inf of 210000 elements",
                   "odd": "0 NaN and 1 Inf of 65 elements"}


def test_dcp_deep_in_place_agrees_with_reader_on_fixtures():
    for root in (FIXTURES / "mcore016_gpt_tp2pp2_bf16_optim" / "iter_0000010",
                 FIXTURES / "mcore015_gpt_flattened_optim" / "iter_0000010"):
        meta = inspect(root).meta
        sizes = {f: (root / f).stat().st_size
                 for f in {c.file for t in meta.tensors.values() for c in t.chunks}}
        findings, counted = integrity.scan_archives(root, meta, sizes, {}, set(), deep=True)
        assert findings == [] and set(counted) == set(meta.tensors)  # every key in place
        assert all(v == (0, 0) for v in counted.values())


def test_torch_save_file_crc_and_deep_in_place(tmp_path):
    sd = {"a": torch.randn(100, 10), "b": torch.ones(5)}
    sd["a"][3, 3] = float("nan")
    torch.save(sd, tmp_path / "m.pt")
    r = validate(tmp_path / "m.pt", deep=True)
    assert r.ok and r.stats["zip_items_checked"] == 1 and r.stats["tensors_read"] == 2
    assert [(f.key, f.message) for f in r.findings] == [("a", "1 NaN and 0 Inf of 1000 "
                                                         "elements")]
    blob = (tmp_path / "m.pt").read_bytes()
    rec = next(x for x in zip_records(blob) if x.size == 4000)
    _poke(tmp_path / "m.pt", rec.start + 100, bytes([blob[rec.start + 100] ^ 1]), fix_crc=False)
    r = validate(tmp_path / "m.pt")
    assert [(f.key, f.file) for f in r.errors] == [("a", "m.pt")]
    assert rec.name in r.errors[0].message and "CRC" in r.errors[0].message


def _dcp_item(tmp_path):
    root = Path(shutil.copytree(FIXTURES / "dcp_plain", tmp_path / "dcp"))
    meta = inspect(root).meta
    key = next(k for k in sorted(meta.tensors) if meta.tensors[k].chunks[0].byte_length > 500)
    return root, key, meta.tensors[key].chunks[0]


def test_dcp_item_with_a_damaged_directory_is_one_error_and_deep_goes_on(tmp_path):
    root, key, c = _dcp_item(tmp_path)
    blob = bytearray((root / c.file).read_bytes())
    end = c.byte_offset + c.byte_length
    blob[end - 22:end] = b"\xee" * 22  # the item's end-of-central-directory record
    (root / c.file).write_bytes(bytes(blob))
    r = validate(root, deep=True)
    assert [(f.key, f.file) for f in r.errors] == [(key, c.file)]
    assert "torch.save archive" in r.errors[0].message
    meta = inspect(root).meta  # deep skips what lives in a file already reported broken
    assert r.stats["tensors_read"] == sum(all(x.file != c.file for x in t.chunks)
                                          for t in meta.tensors.values()) > 0


def test_dcp_item_whose_pickle_is_garbage_but_crc_right_is_a_read_error(tmp_path):
    root, key, c = _dcp_item(tmp_path)
    path = root / c.file
    item = path.read_bytes()[c.byte_offset:c.byte_offset + c.byte_length]
    pkl = next(r for r in zip_records(item) if r.name.endswith("data.pkl"))
    blob = bytearray(path.read_bytes())
    sub = bytearray(blob[c.byte_offset:c.byte_offset + c.byte_length])
    sub[pkl.start:pkl.start + pkl.size] = b"\xff" * pkl.size  # and a CRC that matches it
    _set_crc(sub, pkl.name, zlib.crc32(sub[pkl.start:pkl.start + pkl.size]))
    blob[c.byte_offset:c.byte_offset + c.byte_length] = sub
    path.write_bytes(bytes(blob))
    assert validate(root).ok  # intact as a zip archive
    r = validate(root, deep=True)
    assert [f.key for f in r.errors] == [key] and "cannot read" in r.errors[0].message
