"""``validate`` op: the pure checks on synthetic metadata (no I/O), then broken checkpoints
built from copies of the fixtures in tmp_path."""

import io
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta
from ckpt_tool.ops.validate._checks import check_coverage, check_expectations, check_storage
from ckpt_tool.model import Finding
from ckpt_tool.formats.containers.torch_zip.archive_check import BoundedReader, check_zip_item
from ckpt_tool.ops.validate import validate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
ZARR = FIXTURES / "mcore015_zarr_gpt_tp2pp2" / "iter_0000010"
DCP = FIXTURES / "dcp_plain"


def _t(shape, boxes, *, stored_shape=None, dtype="float32", key="w"):
    chunks = tuple(ChunkRef(offsets=tuple(o), sizes=tuple(s), file="f") for o, s in boxes)
    return TensorMeta(key, dtype, tuple(shape), chunks, stored_shape=stored_shape)


def _msgs(findings):
    return [f.message for f in findings if f.severity == "error"]


# -- pure: coverage -------------------------------------------------------------------------

def test_exact_grid_is_clean():
    boxes = [((i, j), (2, 3)) for i in (0, 2) for j in (0, 3)]
    assert check_coverage(_t((4, 6), boxes)) == []


def test_stacked_layers_grid_is_clean():
    boxes = [((l, r, 0), (1, 4, 6)) for l in range(8) for r in (0, 4)]
    assert check_coverage(_t((8, 8, 6), boxes)) == []


def test_gap_is_an_error():
    boxes = [((0, 0), (2, 6)), ((2, 0), (1, 6))]
    msgs = _msgs(check_coverage(_t((4, 6), boxes)))
    assert len(msgs) == 1 and "cover 18 of 24" in msgs[0] and "gap" in msgs[0]


def test_overlap_is_an_error():
    boxes = [((0, 0), (3, 3)), ((2, 0), (2, 3)), ((0, 3), (3, 3)), ((3, 3), (1, 3))]
    msgs = _msgs(check_coverage(_t((4, 6), boxes)))
    assert any("overlap" in m and "[0:3, 0:3]" in m and "[2:4, 0:3]" in m for m in msgs)


def test_overlap_is_found_even_when_volume_matches():
    # 12 + 6 + 6 = 24 elements, but rows 0:2 of the left half are stored twice, rows 2:4 never
    boxes = [((0, 0), (2, 3)), ((0, 0), (2, 3)), ((0, 3), (4, 3))]
    msgs = _msgs(check_coverage(_t((4, 6), boxes)))
    assert any("overlap" in m for m in msgs)
    assert any("cover 18 of 24" in m and "besides the overlap" in m for m in msgs)


def test_overlap_along_non_sweep_dimension():
    # all chunks share dim-0 offset 0: the sweep runs along dim 1
    boxes = [((0, 0), (4, 4)), ((0, 3), (4, 3))]
    msgs = _msgs(check_coverage(_t((4, 6), boxes)))
    assert any("overlap" in m for m in msgs)


def test_duplicate_chunk_is_an_overlap():
    boxes = [((0, 0), (4, 6)), ((0, 0), (4, 6))]
    assert any("overlap" in m for m in _msgs(check_coverage(_t((4, 6), boxes))))


def test_out_of_bounds_and_wrong_rank():
    boxes = [((0, 0), (4, 6)), ((3, 0), (2, 6)), ((0,), (4,))]
    msgs = _msgs(check_coverage(_t((4, 6), boxes)))
    assert any("outside" in m and "[3:5, 0:6]" in m for m in msgs)
    assert any("rank 1" in m for m in msgs)


def test_no_chunks():
    assert "no chunk stored" in _msgs(check_coverage(_t((4,), [])))[0]


def test_scalar_and_empty_tensors():
    assert check_coverage(_t((), [((), ())])) == []
    assert check_coverage(_t((0, 5), [])) == []


def test_stored_shape_is_what_chunks_cover():
    # logical [4, 6] stored N-D reformulated as [2, 2, 6]
    boxes = [((i, j, 0), (1, 1, 6)) for i in (0, 1) for j in (0, 1)]
    assert check_coverage(_t((4, 6), boxes, stored_shape=(2, 2, 6))) == []
    msgs = _msgs(check_coverage(_t((4, 6), boxes[:3], stored_shape=(2, 2, 6))))
    assert "stored shape" in msgs[0] and "cover 18 of 24" in msgs[0]
    bad = _msgs(check_coverage(_t((4, 6), boxes, stored_shape=(2, 2, 5))))
    assert any("does not hold the logical shape" in m for m in bad)


def test_unknown_dtype():
    assert any("unknown dtype" in m for m in _msgs(check_coverage(
        _t((2,), [((0,), (2,))], dtype="float7"))))


def test_many_chunks_cover_exactly():
    """16,000 chunks (the size of a real TP8 checkpoint's largest tensors' chunk lists): the
    full set covers, and one missing or one doubled chunk is found (no timing assert: the
    suite's time shows a quadratic check)."""
    boxes = [((l, r), (1, 64)) for l in range(2000) for r in range(0, 512, 64)]
    assert check_coverage(_t((2000, 512), boxes)) == []
    assert check_coverage(_t((2000, 512), boxes[:7777] + boxes[7778:])) != []
    assert check_coverage(_t((2000, 512), boxes + [boxes[123]])) != []


# -- pure: storage and expectations ---------------------------------------------------------

def _meta(tensors=(), objects=(), common=None):
    return CheckpointMeta("dcp", "/x", {t.key: t for t in tensors}, tuple(objects),
                          common or {})


def test_storage_missing_and_truncated_files():
    t = TensorMeta("w", "float32", (4,), (
        ChunkRef((0,), (2,), "a.distcp", 0, 100, layout="torch_save"),
        ChunkRef((2,), (2,), "b.distcp", 100, 100, layout="torch_save")))
    o = ObjectMeta("o", "o/shard_0_1", "a.distcp", 180, 30)
    found = check_storage(_meta([t], [o]), {"a.distcp": 200, "b.distcp": None})
    msgs = _msgs(found)
    assert any("b.distcp is missing" in m for m in msgs)
    assert any("a.distcp is truncated" in m and "[180, 210)" in m for m in msgs)
    assert all(isinstance(f, Finding) for f in found)


def test_storage_raw_chunk_length_must_match():
    t = TensorMeta("w", "float32", (4,), (ChunkRef((0,), (4,), "w/0", 0, 12, layout="raw"),))
    assert any("needs 16" in m for m in _msgs(check_storage(_meta([t]), {"w/0": 12})))


def test_expectations():
    m = _meta([_t((2,), [((0,), (2,))])], common={"parallel": {"tp": 2, "pp": 1},
                                                   "iteration": 10})
    assert check_expectations(m, expect_tp=2, expect_pp=1, expect_keys=["w"],
                              expect_iteration=10) == []
    msgs = _msgs(check_expectations(m, expect_tp=4, expect_pp=2, expect_keys=["w", "v"],
                                    expect_iteration=20))
    assert len(msgs) == 4
    found = check_expectations(m, expect_keys=["v"])
    assert found[0].key == "v"
    assert "records no" in _msgs(check_expectations(_meta(), expect_tp=2))[0]


def test_finding_to_dict():
    f = Finding("warning", "k", "f", "m")
    assert f.to_dict() == {"severity": "warning", "key": "k", "file": "f", "message": "m"}


# -- zip integrity --------------------------------------------------------------------------

def _archive() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", b"pickle")
        zf.writestr("archive/data/0", bytes(range(256)) * 8)
    return buf.getvalue()


def _data_start(blob: bytes, name: str) -> int:
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        info = zf.getinfo(name)
    off = info.header_offset
    n, m = struct.unpack("<HH", blob[off + 26:off + 30])
    return off + 30 + n + m


def test_check_zip_item_in_a_bounded_view():
    a = _archive()
    blob = b"x" * 100 + a + b"y" * 50
    f = io.BytesIO(blob)
    assert check_zip_item(f, 100, len(a)) is None
    bad = bytearray(blob)
    bad[100 + _data_start(a, "archive/data/0") + 7] ^= 0xFF
    why = check_zip_item(io.BytesIO(bytes(bad)), 100, len(a))
    assert why is not None and "CRC" in why
    assert check_zip_item(io.BytesIO(blob), 100, 10) is not None
    r = BoundedReader(io.BytesIO(blob), 100, len(a))
    assert r.read(2) == b"PK" and r.tell() == 2 and r.seek(0, 2) == len(a) and r.read() == b""


# -- on copies of the fixtures --------------------------------------------------------------

@pytest.fixture
def mcore(tmp_path):
    return Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))


@pytest.fixture
def dcp(tmp_path):
    return Path(shutil.copytree(DCP, tmp_path / "dcp"))


@pytest.mark.parametrize("path", [MCORE, MCORE.parent, ZARR, DCP])
def test_fixtures_are_valid(path):
    r = validate(path)
    assert r.ok and r.errors == [], r.findings
    assert r.stats["tensors"] > 0


def _first_chunk(path):
    from ckpt_tool.ops.inspect import inspect

    meta = inspect(path).meta
    return next(c for t in meta.tensors.values() for c in t.chunks if c.byte_length > 200)


def test_truncated_and_deleted_distcp(mcore):
    (mcore / "__1_0.distcp").unlink()
    with open(mcore / "__2_1.distcp", "r+b") as f:
        f.truncate(100)
    r = validate(mcore)
    files = {f.file for f in r.errors}
    assert {"__1_0.distcp", "__2_1.distcp"} <= files
    assert any("missing" in f.message for f in r.errors if f.file == "__1_0.distcp")
    assert any("truncated" in f.message for f in r.errors if f.file == "__2_1.distcp")


def test_flipped_byte_is_a_crc_error(dcp):
    c = _first_chunk(dcp)
    blob = bytearray((dcp / c.file).read_bytes())
    item = bytes(blob[c.byte_offset:c.byte_offset + c.byte_length])
    names = zipfile.ZipFile(io.BytesIO(item)).namelist()
    data_name = next(n for n in names if "/data/" in n)
    blob[c.byte_offset + _data_start(item, data_name)] ^= 0x01
    (dcp / c.file).write_bytes(bytes(blob))
    r = validate(dcp)
    assert len(r.errors) == 1 and "CRC" in r.errors[0].message
    assert r.errors[0].file == c.file and r.errors[0].key


def test_stale_distcp_and_tmp_are_warnings(dcp):
    shutil.copy(dcp / "__0_0.distcp", dcp / "__7_0.distcp")
    (dcp / ".metadata.tmp").write_bytes(b"")
    r = validate(dcp)
    assert r.ok
    assert {f.file for f in r.warnings} == {"__7_0.distcp", ".metadata.tmp"}


def test_missing_metadata_json_is_an_error_finding(mcore):
    (mcore / "metadata.json").unlink()
    r = validate(mcore)
    assert not r.ok and r.errors[0].file == "metadata.json"
    assert "not a complete checkpoint" in r.errors[0].message
    assert r.format == "dcp" and r.stats["tensors"] > 0  # the data is still checked


def test_missing_dot_metadata(mcore):
    (mcore / ".metadata").unlink()
    r = validate(mcore)
    assert [f.file for f in r.errors] == [".metadata"]


def test_tracker_pointing_at_missing_iteration(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(MCORE, save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    r = validate(save)
    assert not r.ok and "iter_0000020" in r.errors[0].message
    assert "iter_0000010" in r.errors[0].message


def test_zarr_missing_chunk_file(tmp_path):
    z = Path(shutil.copytree(ZARR, tmp_path / "z"))
    victim = next(p for p in sorted(z.rglob("0.1")) if p.is_file())
    victim.unlink()
    r = validate(z)
    assert any("gap" in f.message and f.key == victim.parent.relative_to(z).as_posix()
               for f in r.errors)


def test_integrity_json(mcore):
    import hashlib
    import json

    good = hashlib.sha256((mcore / "__0_0.distcp").read_bytes()).hexdigest()
    (mcore / "integrity.json").write_text(json.dumps({"algorithm": "sha256", "files": {
        "__0_0.distcp": good, "__0_1.distcp": "0" * 64, "gone.distcp": good}}))
    r = validate(mcore)
    assert {f.file for f in r.errors} == {"__0_1.distcp", "gone.distcp"}


def test_everything_at_once(mcore):
    (mcore / "__3_1.distcp").unlink()
    with open(mcore / "__0_1.distcp", "r+b") as f:
        f.truncate(50)
    shutil.copy(mcore / "__0_0.distcp", mcore / "__9_0.distcp")
    r = validate(mcore, expect_tp=8, expect_iteration=11, expect_keys=["no.such.key"])
    msgs = " | ".join(f.message for f in r.findings)
    assert "__3_1.distcp is missing" in msgs and "__0_1.distcp is truncated" in msgs
    assert "tp=8" in msgs and "iteration 11" in msgs
    assert any(f.key == "no.such.key" for f in r.errors)
    assert [f.file for f in r.warnings] == ["__9_0.distcp"]


def test_deep_counts_nan(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_api

    w = torch.ones(4, 4)
    w[0, 0] = float("nan")
    w[1, 1] = float("inf")
    dcp_api.save({"w": w, "ok": torch.zeros(3), "step": 5}, checkpoint_id=tmp_path / "ck",
                 no_dist=True)
    assert validate(tmp_path / "ck").findings == []
    r = validate(tmp_path / "ck", deep=True)
    assert r.ok and r.stats["tensors_read"] == 2
    assert [(f.severity, f.key) for f in r.findings] == [("warning", "w")]
    assert "1 NaN and 1 Inf of 16" in r.findings[0].message


def test_unparseable_markers_are_error_findings(mcore, dcp):
    b = (dcp / ".metadata").read_bytes()
    (dcp / ".metadata").write_bytes(b[:len(b) // 2])
    r = validate(dcp)
    assert [f.file for f in r.errors] == [".metadata"] and "unreadable" in r.errors[0].message
    (mcore / "metadata.json").write_text("{bad")
    r = validate(mcore)
    assert [f.file for f in r.errors] == ["metadata.json"]


def test_many_truncated_items_are_one_finding_per_file(mcore):
    with open(mcore / "__0_0.distcp", "r+b") as f:
        f.truncate(10)
    r = validate(mcore)
    short = [f for f in r.errors if f.file == "__0_0.distcp"]
    assert len(short) == 1 and "items end past its 10 bytes" in short[0].message


def test_an_emptied_data_file_is_called_empty(mcore):
    (mcore / "__0_0.distcp").write_bytes(b"")
    r = validate(mcore)
    [empty] = [f for f in r.errors if f.file == "__0_0.distcp"]
    assert empty.message.startswith("data file __0_0.distcp is empty (0 bytes); it should hold ")


def test_damaged_common_pt_still_checks_the_data(mcore):
    b = (mcore / "common.pt").read_bytes()
    (mcore / "common.pt").write_bytes(b[:len(b) // 2])
    (mcore / "__0_0.distcp").unlink()
    r = validate(mcore)
    assert {f.file for f in r.errors} == {"common.pt", "__0_0.distcp"}
    assert r.stats["tensors"] > 0


def test_missing_common_pt(mcore):
    (mcore / "common.pt").unlink()
    r = validate(mcore)
    assert [f.file for f in r.errors] == ["common.pt"]


def test_deep_reads_big_tensors_in_slabs(tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp_api

    import ckpt_tool.ops.validate._deep as v

    w = torch.zeros(10, 4)
    w[7, 2] = float("nan")
    dcp_api.save({"w": w}, checkpoint_id=tmp_path / "ck", no_dist=True)
    from ckpt_tool.ops.inspect import inspect

    monkeypatch.setattr(v, "_DEEP_SLAB_BYTES", 48)  # 3 rows of 4 float32 per slab
    assert len(list(v._slabs(inspect(tmp_path / "ck").meta.tensors["w"]))) == 4
    r = validate(tmp_path / "ck", deep=True)
    assert [f.message for f in r.findings] == ["1 NaN and 0 Inf of 40 elements"]
    assert r.nonfinite == {"w": (1, 0, 40)}


def test_modelopt_state_sub_checkpoint_is_validated(mcore):
    sub = Path(shutil.copytree(MCORE, mcore / "modelopt_state"))
    assert validate(mcore).ok
    victim = sorted(sub.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    result = validate(mcore)
    assert not result.ok
    assert any(f.file == f"modelopt_state/{victim.name}" and "truncated" in f.message
               for f in result.errors)
