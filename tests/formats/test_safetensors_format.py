"""safetensors format: detection, torch-free metadata, bit-exact full and sliced reads, errors."""

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import CorruptCheckpointError, NotACheckpointError
from ckpt_tool.formats import detect, open_checkpoint

TENSORS = {
    "w.fp32": torch.randn(6, 5),
    "w.bf16": torch.randn(4, 3, 2).to(torch.bfloat16),
    "ids": torch.arange(-5, 7, dtype=torch.int64).reshape(3, 4),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "f8": torch.randn(8).to(torch.float8_e4m3fn),
    "empty": torch.zeros(0, 4),
}


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.is_floating_point and a.element_size() in (1, 2):
        a, b = a.view(torch.uint8 if a.element_size() == 1 else torch.int16), \
            b.view(torch.uint8 if b.element_size() == 1 else torch.int16)
    assert torch.equal(a, b)


@pytest.fixture
def single(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file(TENSORS, str(f), metadata={"format": "pt", "note": "x"})
    return f


@pytest.fixture
def sharded(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    parts = {"model-00001-of-00002.safetensors": ["w.fp32", "ids"],
             "model-00002-of-00002.safetensors": ["w.bf16", "mask"]}
    wmap = {}
    for name, keys in parts.items():
        save_file({k: TENSORS[k] for k in keys}, str(d / name))
        wmap.update({k: name for k in keys})
    total = sum(TENSORS[k].nbytes for k in wmap)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}))
    return d


def test_sniff_and_metadata_match_safe_open(single):
    assert detect(single).name == "safetensors"
    meta = open_checkpoint(single).metadata()
    assert meta.format == "safetensors" and meta.extras["metadata"] == {"format": "pt", "note": "x"}
    assert set(meta.tensors) == set(TENSORS)
    with safe_open(str(single), "pt") as f:
        for k in f.keys():
            t, ref = meta.tensors[k], f.get_tensor(k)
            assert t.dtype == str(ref.dtype).removeprefix("torch.")
            assert t.shape == tuple(ref.shape) and t.nbytes == ref.nbytes
            (c,) = t.chunks
            assert c.layout == "raw" and c.file == "model.safetensors" and c.byte_length == ref.nbytes
    # the chunk's byte range holds exactly the tensor's bytes
    c = meta.tensors["ids"].chunks[0]
    raw = single.read_bytes()[c.byte_offset:c.byte_offset + c.byte_length]
    assert raw == TENSORS["ids"].numpy().tobytes()


def test_reads_bit_exact(single):
    r = open_checkpoint(single)
    for k, ref in TENSORS.items():
        _same(r.read(k), ref)
    _same(r.read("w.fp32", (slice(2, 5),)), TENSORS["w.fp32"][2:5])
    _same(r.read("w.bf16", (slice(1, 3), slice(None), slice(1, 2))), TENSORS["w.bf16"][1:3, :, 1:2])
    _same(r.read("ids", (slice(None), slice(1, 3))), TENSORS["ids"][:, 1:3])
    _same(r.read("f8", (slice(2, 6),)), TENSORS["f8"][2:6])
    _same(r.read("w.fp32", (slice(3, 3),)), TENSORS["w.fp32"][3:3])


def test_sharded_dir_with_index(sharded):
    assert detect(sharded).name == "safetensors"
    meta = open_checkpoint(sharded).metadata()
    assert set(meta.tensors) == {"w.fp32", "ids", "w.bf16", "mask"}
    assert meta.tensors["w.bf16"].chunks[0].file == "model-00002-of-00002.safetensors"
    assert meta.extras["index_metadata"]["total_size"] == meta.total_bytes
    r = open_checkpoint(sharded)
    for k in meta.tensors:
        _same(r.read(k), TENSORS[k])
    _same(r.read("w.bf16", (slice(2, 4),)), TENSORS["w.bf16"][2:4])


def test_dir_without_index(sharded):
    (sharded / "model.safetensors.index.json").unlink()
    meta = open_checkpoint(sharded).metadata()
    assert len(meta.tensors) == 4 and len(meta.extras["files"]) == 2
    save_file({"ids": TENSORS["ids"]}, str(sharded / "dup.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="stored in both"):
        open_checkpoint(sharded).metadata()


def test_metadata_does_not_import_torch(single):
    code = ("import sys\nfrom ckpt_tool.formats import open_checkpoint\n"
            f"m = open_checkpoint({str(single)!r}).metadata()\n"
            "assert m.tensors['w.bf16'].dtype == 'bfloat16'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard only


def _header(f):
    n = struct.unpack("<Q", f.read_bytes()[:8])[0]
    return n, json.loads(f.read_bytes()[8:8 + n])


def _rewrite(f, header, n=None):
    raw = json.dumps(header).encode()
    data = f.read_bytes()[8 + _header(f)[0]:]
    f.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)


def test_errors(single, tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01\x02")
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        open_checkpoint(bad).metadata()
    bad.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CorruptCheckpointError, match="beyond the file size") as e:
        open_checkpoint(bad).metadata()
    assert "bad.safetensors" in str(e.value)
    bad.write_bytes(struct.pack("<Q", 5) + b"{oops")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        open_checkpoint(bad).metadata()
    n, h = _header(single)
    h["ids"]["data_offsets"] = [h["ids"]["data_offsets"][0], h["ids"]["data_offsets"][1] + 8]
    _rewrite(single, h)
    with pytest.raises(CorruptCheckpointError, match="data_offsets"):
        open_checkpoint(single).metadata()
    # truncated data
    save_file(TENSORS, str(single))
    single.write_bytes(single.read_bytes()[:-16])
    with pytest.raises(CorruptCheckpointError, match="beyond"):
        open_checkpoint(single).metadata()


def test_index_names_missing_file(sharded):
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        open_checkpoint(sharded).metadata()


def test_not_safetensors(tmp_path):
    (tmp_path / "x.txt").write_text("hello world, not a checkpoint")
    with pytest.raises(NotACheckpointError, match="safetensors: no safetensors header"):
        detect(tmp_path / "x.txt")
    with pytest.raises(NotACheckpointError, match="safetensors: no \\*.safetensors"):
        detect(tmp_path)


def test_cli_inspect_json(single, sharded):
    runner = CliRunner()
    for path, n in ((single, len(TENSORS)), (sharded, 4)):
        result = runner.invoke(app, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc["format"] == "safetensors" and doc["totals"]["tensors"] == n
        assert doc["tensors"]["w.bf16"] == {"dtype": "bfloat16", "shape": [4, 3, 2], "chunks": 1,
                                            "nbytes": 48, "split": "1 chunk: whole"}
    result = runner.invoke(app, ["inspect", str(single)])
    assert result.exit_code == 0 and "safetensors" in result.output


def test_dim0_slice_reads_only_rows(single, monkeypatch):
    import numpy as np

    def no_memmap(*a, **k):
        raise AssertionError("dim-0 slices must not map the whole tensor")

    monkeypatch.setattr(np, "memmap", no_memmap)
    r = open_checkpoint(single)
    _same(r.read("w.bf16", (slice(1, 3),)), TENSORS["w.bf16"][1:3])
    _same(r.read("ids"), TENSORS["ids"])


def test_index_maps_tensor_to_wrong_file(sharded):
    idx = sharded / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["ids"] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="does not hold it"):
        open_checkpoint(sharded).metadata()
    idx.write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="index.json is not valid JSON"):
        open_checkpoint(sharded).metadata()
