"""Integrity manifests (issue 15, item 2): every output carries one, the real loaders still load
it with the manifest present, ``validate`` checks it, ``validate --write-manifest`` adds one."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.integrity_manifest import build_manifest, check_manifest, digest_file
from ckpt_tool.ops.validate import validate

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIX / "mcore016_gpt_tp2pp2_fp32"
DCP = FIX / "dcp_plain"


def _convert(src: Path, dst: Path, to: str) -> Path:
    r = runner.invoke(app, ["convert", str(src), str(dst), "--to", to, "--quiet"])
    assert r.exit_code == 0, r.output
    return dst


def _flip(path: Path, offset_from_end: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_digests_stream_and_match_hashlib(tmp_path):
    import zlib

    data = os.urandom((8 << 20) + 12345)  # more than one block
    (tmp_path / "f").write_bytes(data)
    assert digest_file(tmp_path / "f", "sha256") == (len(data), hashlib.sha256(data).hexdigest())
    assert digest_file(tmp_path / "f", "crc32") == (len(data), f"{zlib.crc32(data):08x}")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """One convert output per target format, from the Megatron-Core fixture."""
    base = tmp_path_factory.mktemp("outs")
    return {to: _convert(MCORE, base / to, to)
            for to in ("safetensors", "torch", "dcp", "legacy", "torch_dist")}


def test_every_output_carries_a_manifest_that_lists_every_file(outputs):
    for to, out in outputs.items():
        name = "integrity.json" if to == "torch_dist" else "ckpt-manifest.json"
        if to == "torch_dist":  # a save directory's: in its checkpoint's directory
            out = out / "iter_0000010"
        doc = json.loads((out / name).read_text())
        assert doc["algorithm"] == ("sha256" if to == "torch_dist" else "crc32"), to
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                       if p.is_file() and p.name != name)
        assert sorted(doc["files"]) == files == sorted(doc["sizes"]), to
        assert check_manifest(out, deep=True) == [], to
        r = validate(out, deep=True)
        assert r.ok and r.stats["manifest_files_hashed"] == len(files), (to, r.findings)


def test_real_loaders_load_outputs_with_the_manifest_present(outputs, tmp_path):
    import safetensors.torch
    import torch
    import torch.distributed.checkpoint as dcp

    tensors = safetensors.torch.load_file(outputs["safetensors"] / "model.safetensors")
    assert len(tensors) == 17
    sd = torch.load(outputs["torch"] / "model.pt", weights_only=True)
    assert isinstance(sd, dict) and sd
    # DCP: its FileSystemReader reads .metadata and the files it names; the sidecar is ignored
    meta = dcp.FileSystemReader(str(outputs["dcp"])).read_metadata()
    want = {k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(want, checkpoint_id=outputs["dcp"])
    assert all(torch.isfinite(v).all() for v in want.values() if v.is_floating_point())
    # Megatron-LM legacy: the tracker names the iteration, each rank file is a torch.load
    save = outputs["legacy"]
    it = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    rank_file = next((save / f"iter_{int(it):07d}").rglob("model_optim_rng.pt"))
    assert "model" in torch.load(rank_file, weights_only=False)
    # our readers: the sidecar is no data (a directory holding model.pt and its manifest)
    assert validate(outputs["torch"]).format == "torch"


@pytest.mark.interop
@pytest.mark.multiproc
@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None,
                    reason="megatron-core is not installed")
def test_megatron_core_loads_torch_dist_output_with_integrity_json(outputs, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
    from _compare import mcore_view  # noqa: E402

    checkpoint = outputs["torch_dist"] / "iter_0000010"
    assert (checkpoint / "integrity.json").is_file()
    view = mcore_view(checkpoint, tmp_path / "view.pt")
    assert len(view["plain"]) == 17


def test_flipped_safetensors_byte_is_an_error_with_deep(tmp_path, outputs):
    out = Path(shutil.copytree(outputs["safetensors"], tmp_path / "st"))
    _flip(out / "model.safetensors")  # inside the last tensor's data
    assert validate(out).ok  # same size: the cheap check cannot see it
    r = validate(out, deep=True)
    assert [f.file for f in r.errors] == ["model.safetensors"]
    assert "does not match ckpt-manifest.json" in r.errors[0].message
    res = runner.invoke(app, ["validate", str(out), "--deep"])
    assert res.exit_code == 1 and "does not match" in res.stderr


def test_size_change_and_missing_file_are_errors_without_deep(tmp_path, outputs):
    out = Path(shutil.copytree(outputs["dcp"], tmp_path / "d"))
    with open(out / ".metadata", "ab") as f:
        f.write(b"\0")  # the pickle still loads: only the manifest sees it
    (out / "extra.txt").write_text("x")
    r = validate(out)
    assert any(f.file == ".metadata" and "records" in f.message for f in r.errors)
    assert any(f.file == "extra.txt" and "not listed" in f.message for f in r.warnings)
    doc = json.loads((out / "ckpt-manifest.json").read_text())
    doc["files"]["gone.distcp"] = "0" * 8
    (out / "ckpt-manifest.json").write_text(json.dumps(doc))
    assert any(f.file == "gone.distcp" and "missing" in f.message for f in validate(out).errors)


def test_single_file_output_has_its_manifest_beside_it(tmp_path):
    out = tmp_path / "m.safetensors"
    _convert(DCP, out, "safetensors")
    side = tmp_path / "m.safetensors.ckpt-manifest.json"
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors", side.name]
    assert json.loads(side.read_text())["files"] == {
        "m.safetensors": digest_file(out, "crc32")[1]}
    _flip(out)
    assert not validate(out, deep=True).ok


def test_legacy_save_dir_manifest_checks_the_iteration_dir(tmp_path, outputs):
    save = Path(shutil.copytree(outputs["legacy"], tmp_path / "save"))
    it = next(save.glob("iter_*"))
    victim = next(it.rglob("model_optim_rng.pt"))
    _flip(victim, 5000)
    rel = victim.relative_to(it).as_posix()
    for path, shown in ((save, f"{it.name}/{rel}"), (it, rel)):  # (the zip CRC sees it too)
        r = validate(path, deep=True)
        assert any(f.file == shown and "does not match ckpt-manifest.json" in f.message
                   for f in r.errors), (path, r.findings)


def test_write_manifest_adds_only_the_manifest(tmp_path):
    ck = Path(shutil.copytree(DCP, tmp_path / "dcp"))
    before = _tree(ck)
    r = runner.invoke(app, ["validate", str(ck), "--write-manifest"])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.stderr and "ckpt-manifest.json" in r.stderr
    after = _tree(ck)
    assert after.pop("ckpt-manifest.json") and after == before  # nothing else touched
    assert sorted(os.listdir(ck)) == sorted([*before, "ckpt-manifest.json"])  # no temp file
    _flip(ck / "__0_0.distcp", 3)
    r = runner.invoke(app, ["validate", str(ck), "--deep"])
    assert r.exit_code == 1
    # a manifest that no longer matches is not replaced; nor is one written for a bad input
    r = runner.invoke(app, ["validate", str(ck), "--write-manifest"])
    assert r.exit_code == 1 and "not" in r.stderr and "Traceback" not in r.output
    assert json.loads((ck / "ckpt-manifest.json").read_text()) == build_manifest(
        DCP, algorithm="crc32")


def test_write_manifest_on_megatron_core_dir_is_integrity_json(tmp_path):
    ck = Path(shutil.copytree(MCORE, tmp_path / "m"))
    it = next(ck.glob("iter_*"))
    r = runner.invoke(app, ["validate", str(it), "--write-manifest"])
    assert r.exit_code == 0, r.output
    doc = json.loads((it / "integrity.json").read_text())
    assert doc["algorithm"] == "sha256" and "metadata.json" in doc["files"]
    assert validate(it, deep=True).ok
