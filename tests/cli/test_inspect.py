"""``ckpt inspect``: human and JSON output, exit codes, one-line errors, no torch import."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from _builders import split_grid, write_mcore_dist, write_zarr  # noqa: E402

from ckpt_tool.cli.app import app  # noqa: E402

runner = CliRunner()
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"


@pytest.fixture
def ckpt(tmp_path):
    w = torch.arange(24.0).reshape(4, 6)
    layers = torch.zeros(4, 8, 6, dtype=torch.bfloat16)
    return write_mcore_dist(tmp_path / "iter_0000010", {
        "decoder.w": ((4, 6), split_grid(w, (2, 2))),
        "decoder.layers.self_attention.linear_qkv.weight": ((4, 8, 6), split_grid(layers, (4, 2, 1))),
    }, {"rng_state/shard_0.0_1.1": {"seed": 0}},
        common={"iteration": 10, "checkpoint_version": 3.0})


def _one_error_line(result):
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("ckpt: error:"), result.output
    return lines[0]


def test_json(ckpt):
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "torch_dist"
    assert doc["tensors"]["decoder.w"] == {"dtype": "float32", "shape": [4, 6], "chunks": 4,
                                           "nbytes": 96, "split": "4 chunks: dim0 ×2 × dim1 ×2"}
    qkv = doc["tensors"]["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv["dtype"] == "bfloat16" and qkv["split"] == "8 chunks: dim0 ×2 × 4 layers"
    assert doc["objects"][0]["unique_key"] == "rng_state/shard_0.0_1.1"
    assert doc["common"]["iteration"] == 10
    assert doc["dtype_totals"]["float32"] == {"tensors": 1, "numel": 24, "nbytes": 96}


def test_human_output(ckpt):
    (ckpt.parent / "latest_checkpointed_iteration.txt").write_text("10")
    result = runner.invoke(app, ["inspect", str(ckpt.parent)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("torch_dist", "sharded_backend=torch_dist", "iteration: 10", "decoder.w",
                 "4 chunks: dim0 ×2 × dim1 ×2", "rng_state/shard_0.0_1.1", "totals per dtype",
                 "bfloat16", "optimizer sharding: no optimizer state"):
        assert text in out, text


def test_zarr(tmp_path):
    ck = write_zarr(tmp_path / "z", {"decoder.w": (torch.ones(4, 6), (2, 6))}, common={"iteration": 3})
    doc = json.loads(runner.invoke(app, ["inspect", str(ck), "--json"]).stdout)
    assert doc["format"] == "zarr" and doc["tensors"]["decoder.w"]["chunks"] == 2
    assert doc["extras"]["sharded_backend"] == "zarr"


def test_missing_path(tmp_path):
    line = _one_error_line(runner.invoke(app, ["inspect", str(tmp_path / "nope")]))
    assert "no such file or directory" in line


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "file.txt").write_text("hello")
    line = _one_error_line(runner.invoke(app, ["inspect", str(tmp_path / "file.txt")]))
    assert "not a checkpoint" in line and "torch_dist:" in line and "zarr:" in line
    # a directory holding no checkpoint: one short line (tests/cli/test_inspect_folder.py)
    line = _one_error_line(runner.invoke(app, ["inspect", str(tmp_path)]))
    assert "none in it" in line and "torch_dist:" not in line


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", None])
def test_bad_metadata(ckpt, content):
    md = ckpt / ".metadata"
    md.write_bytes(md.read_bytes()[: len(md.read_bytes()) // 2] if content is None else content)
    line = _one_error_line(runner.invoke(app, ["inspect", str(ckpt), "--json"]))
    assert ".metadata" in line
    assert ("empty" in line) if content == b"" else ("cannot unpickle" in line)


def test_bad_metadata_json(ckpt):
    (ckpt / "metadata.json").write_text('{"sharded_backend": ')
    line = _one_error_line(runner.invoke(app, ["inspect", str(ckpt)]))
    assert "metadata.json is not valid JSON" in line


def test_unsafe_pickle_and_trust(ckpt):
    import types

    torch.save({"iteration": 1, "x": types.SimpleNamespace(a=1)}, ckpt / "common.pt")
    line = _one_error_line(runner.invoke(app, ["inspect", str(ckpt)]))
    assert "types.SimpleNamespace" in line and "--trust" in line
    result = runner.invoke(app, ["inspect", str(ckpt), "--json", "--trust"])
    assert result.exit_code == 0 and json.loads(result.stdout)["common"]["iteration"] == 1


def test_json_path_does_not_import_torch(ckpt):
    code = (
        "import sys, io, contextlib, json\n"
        "from typer.testing import CliRunner\n"
        "from ckpt_tool.cli.app import app\n"
        f"r = CliRunner().invoke(app, ['inspect', {str(ckpt)!r}, '--json'])\n"
        "assert r.exit_code == 0, r.output\n"
        "assert json.loads(r.stdout)['format'] == 'torch_dist'\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(not FIXTURE.is_dir(), reason="fixture not generated")
def test_real_fixture_save_dir():
    doc = json.loads(runner.invoke(app, ["inspect", str(FIXTURE), "--json"]).stdout)
    assert doc["root"].endswith("iter_0000010") and doc["common"]["iteration"] == 10
    assert doc["common"]["parallel"]["tp"] == 2 and doc["common"]["parallel"]["pp"] == 2
    assert doc["tensors"]["decoder.layers.self_attention.linear_qkv.weight"]["split"] == \
        "8 chunks: tp 0-1 along dim 0 × 4 layers"
    assert doc["tensors"]["decoder.layers.self_attention.linear_proj.weight"]["split"] == \
        "8 chunks: tp 0-1 along dim 1 × 4 layers"
