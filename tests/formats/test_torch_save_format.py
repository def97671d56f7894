"""torch.save format: detection, torch-free metadata with byte ranges, reads, errors."""

import argparse
import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import CorruptCheckpointError, NotACheckpointError, UnsupportedError
from ckpt_tool.formats import detect, open_checkpoint
from ckpt_tool.formats.containers.torch_zip.torch_save_files import flatten_state

BASE = torch.randn(6, 4)
STATE = {
    "iteration": 7,
    "args": argparse.Namespace(tensor_model_parallel_size=2, hidden_size=4),
    "model": {
        "emb.weight": BASE,
        "layer": {"bf16": torch.randn(3, 5).to(torch.bfloat16),
                  "ids": torch.arange(10, dtype=torch.int64),
                  "tail": BASE[2:],            # contiguous view at a storage offset
                  "t": BASE.t()},              # non-contiguous view of the same storage
    },
    "opt": {"lr": 0.1, "bufs": [torch.ones(2), torch.zeros(3, dtype=torch.int32)]},
    "u16": torch.arange(4, dtype=torch.int32).to(torch.uint16),
}
PLAIN = {k: v for k, v in STATE.items() if k != "args"}  # loads with weights_only=True


def _same(a, b):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    assert torch.equal(a, b)


@pytest.fixture(params=["namespace", "plain"])
def ckpt(tmp_path, request):
    f = tmp_path / "model_optim_rng.pt"
    torch.save(STATE if request.param == "namespace" else PLAIN, f)
    return f


def test_sniff_and_metadata(ckpt):
    assert detect(ckpt).name == "torch"
    meta = open_checkpoint(ckpt).metadata()
    ref = flatten_state(torch.load(ckpt, weights_only=False))[0]
    assert set(meta.tensors) == set(ref) == {
        "model.emb.weight", "model.layer.bf16", "model.layer.ids", "model.layer.tail",
        "model.layer.t", "opt.bufs.0", "opt.bufs.1", "u16"}
    for k, t in meta.tensors.items():
        assert t.dtype == str(ref[k].dtype).removeprefix("torch.")
        assert t.shape == tuple(ref[k].shape) and t.nbytes == ref[k].nbytes
    data = ckpt.read_bytes()
    for k in ("model.emb.weight", "model.layer.tail", "model.layer.bf16", "u16"):
        (c,) = meta.tensors[k].chunks
        assert c.layout == "raw" and c.file == ckpt.name
        raw = data[c.byte_offset:c.byte_offset + c.byte_length]
        assert raw == ref[k].contiguous().view(torch.uint8).numpy().tobytes(), k
    assert meta.tensors["model.layer.t"].chunks[0].byte_offset is None
    assert meta.extras["without_byte_range"] == ["model.layer.t"]
    assert meta.common["values"]["opt.lr"] == 0.1 and meta.common["values"]["iteration"] == 7
    if "args" in meta.common["values"]:
        assert meta.common["parallel"]["tp"] == 2


def test_reads(ckpt):
    r = open_checkpoint(ckpt)
    ref = flatten_state(torch.load(ckpt, weights_only=False))[0]
    for k in ref:
        _same(r.read(k), ref[k])
    _same(r.read("model.layer.t", (slice(1, 3), slice(0, 2))), BASE.t()[1:3, 0:2])
    _same(r.read("model.layer.bf16", (slice(1, 2),)), STATE["model"]["layer"]["bf16"][1:2])
    assert r.read("model.layer.t").is_contiguous()
    r.close()


def test_metadata_does_not_import_torch(ckpt):
    code = ("import sys\nfrom ckpt_tool.formats import open_checkpoint\n"
            f"m = open_checkpoint({str(ckpt)!r}).metadata()\n"
            "assert m.tensors['model.layer.bf16'].dtype == 'bfloat16'\n"
            "assert m.tensors['u16'].dtype == 'uint16'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)  # a hang guard only


def test_legacy_format_unsupported(tmp_path):
    f = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, f, _use_new_zipfile_serialization=False)
    assert detect(f).name == "torch"
    with pytest.raises(UnsupportedError, match="legacy"):
        open_checkpoint(f)


def test_not_torch_and_damaged(tmp_path, ckpt):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    with pytest.raises(NotACheckpointError, match="torch: not a zip"):
        detect(f)
    ckpt.write_bytes(ckpt.read_bytes()[:200])
    assert detect(ckpt).name == "torch"
    with pytest.raises(CorruptCheckpointError, match="damaged zip") as e:
        open_checkpoint(ckpt).metadata()
    assert ckpt.name in str(e.value)
    result = CliRunner().invoke(app, ["inspect", str(ckpt)])
    assert result.exit_code == 2 and "damaged zip" in result.output


def test_cli_inspect_json(ckpt):
    result = CliRunner().invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "torch" and doc["totals"]["tensors"] == 8
    assert doc["tensors"]["model.layer.bf16"] == {"dtype": "bfloat16", "shape": [3, 5],
                                                  "chunks": 1, "nbytes": 30,
                                                  "split": "1 chunk: whole"}
    result = CliRunner().invoke(app, ["inspect", str(ckpt)])
    assert result.exit_code == 0 and "model.layer.t" in result.output
