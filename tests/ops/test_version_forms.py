"""Megatron-Core 0.14 and 0.19 checkpoints (written by the real libraries: ``fixtures/``)
through ``reshard``, ``convert``, ``inspect`` and ``validate``: each written back in the
source's own form (0.19: one common state, the ``common_state`` object; no ``common.pt``; its
``metadata.json``; an ``integrity.json`` by Megatron-Core's algorithm), and the checkpoints
Megatron-Core refuses or misreads flagged: two common states that disagree, a save without its
completion marker ``metadata.json``."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.formats.containers.torch_zip.torch_save_object import save_object
from ckpt_tool.ops.convert import ConvertOptions, convert
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.ops.reshard import ReshardRequest, reshard
from ckpt_tool.ops.validate import validate

FIX = Path(__file__).resolve().parents[2] / "fixtures"
MCORE019 = FIX / "mcore019_gpt_tp2dp2_distopt_buckets"
MCORE014 = FIX / "mcore014_gpt_tp2dp2_distopt_flattened"
MCORE015 = FIX / "mcore015_gpt_flattened_optim"
runner = CliRunner()
MARKER_019 = b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'


def _common_objects(path: Path) -> list[str]:
    with open_checkpoint(path) as r:
        return [o.unique_key for o in r.metadata().objects if o.key == "common_state"]


def _assert_019_form(out: Path) -> None:
    """0.19's form, and integrity.json as Megatron-Core 0.19 computes it: sha256 of every file
    of the directory but itself (``.metadata``, every ``.distcp``, ``metadata.json``)."""
    out = locate_source(out).checkpoint  # (the fixture is a save directory: so is the output)
    assert not (out / "common.pt").exists()
    assert _common_objects(out) == ["common_state/shard_0_1"]
    assert (out / "metadata.json").read_bytes() == MARKER_019
    manifest = json.loads((out / "integrity.json").read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != "integrity.json")
    assert manifest["algorithm"] == "sha256" and sorted(manifest["files"]) == files
    assert {".metadata", "metadata.json"} <= set(files)
    for name in files:
        assert manifest["files"][name] == hashlib.sha256((out / name).read_bytes()).hexdigest()


def test_reshard_of_a_019_checkpoint_keeps_one_common_state_in_its_form(tmp_path):
    out = tmp_path / "tp1"
    result = runner.invoke(app, ["reshard", str(MCORE019), str(out), "--tp", "1"])
    assert result.exit_code == 0, result.output
    _assert_019_form(out)
    with open_checkpoint(out) as r:
        common = r.common()
    assert common["args"].tensor_model_parallel_size == 1
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert validate(out).ok


def test_convert_of_a_019_checkpoint_keeps_its_form(tmp_path):
    out = tmp_path / "out"
    result = convert(MCORE019, out, ConvertOptions(to="torch_dist"))
    assert result.objects == 24  # the objects of their own; the common state is not one
    _assert_019_form(out)
    with open_checkpoint(MCORE019) as a, open_checkpoint(out) as b:
        assert vars(a.common()["args"]) == vars(b.common()["args"])
    diff = runner.invoke(app, ["diff", str(MCORE019), str(out)])
    assert diff.exit_code == 0, diff.output


def test_convert_of_a_019_checkpoint_to_dcp_keeps_the_common_state_once(tmp_path):
    out = tmp_path / "dcp"
    convert(MCORE019, out, ConvertOptions(to="dcp"))
    with open_checkpoint(out) as r:
        keys = {o.unique_key for o in r.metadata().objects}
        assert not any(k.startswith("common_state") for k in keys)
        assert r.common()["iteration"] == 10


def test_reshard_of_a_014_checkpoint_keeps_common_pt(tmp_path):
    out = tmp_path / "tp1"
    assert reshard(MCORE014, out, ReshardRequest(tp=1)).written
    ckpt = locate_source(out).checkpoint  # (a save directory, as the fixture)
    assert (ckpt / "common.pt").is_file() and not _common_objects(out)
    assert json.loads((ckpt / "metadata.json").read_text())["common_backend"] == "torch"
    assert validate(out).ok


def test_convert_from_a_source_that_is_not_megatron_core_writes_common_pt(tmp_path):
    out = tmp_path / "dist"
    convert(FIX / "dcp_plain", out, ConvertOptions(to="torch_dist"))
    assert (out / "common.pt").is_file() and not _common_objects(out)
    assert "common_backend" in json.loads((out / "metadata.json").read_text())


def _both(tmp_path: Path, **changes) -> Path:
    """The 0.19 fixture plus a ``common.pt`` (what reshard wrote before it kept the form):
    two common states, the file's with ``changes`` to ``args``."""
    both = tmp_path / "both"
    shutil.copytree(next(MCORE019.glob("iter_*")), both)
    (both / "integrity.json").unlink()
    with open_checkpoint(both) as r:
        common = r.common_torch_free_exact()
    for k, v in changes.items():
        setattr(common["args"], k, v)
    save_object(common, both / "common.pt")
    return both


def test_validate_flags_two_contradicting_common_states(tmp_path):
    both = _both(tmp_path, tensor_model_parallel_size=1)
    result = runner.invoke(app, ["validate", str(both), "--json"])
    assert result.exit_code == 1, result.output
    (finding,) = json.loads(result.stdout)["findings"]
    assert finding["severity"] == "error" and finding["file"] == "common.pt"
    assert "two contradicting common states" in finding["message"]
    assert "args.tensor_model_parallel_size: 1 vs 2" in finding["message"]


def test_validate_warns_of_the_same_common_state_stored_twice(tmp_path):
    result = validate(_both(tmp_path))
    assert result.ok
    assert [f.message for f in result.warnings if "stored twice" in f.message]


def test_reshard_of_two_common_states_keeps_the_one_megatron_core_loads(tmp_path):
    """common.pt wins (as in Megatron-Core 0.19): the output has it alone, in the file form."""
    out = tmp_path / "tp1"
    assert reshard(_both(tmp_path, seq_length=64), out, ReshardRequest(tp=1)).written
    assert (out / "common.pt").is_file() and not _common_objects(out)
    with open_checkpoint(out) as r:
        assert r.common()["args"].seq_length == 64
    assert validate(out).ok


@pytest.mark.parametrize("fixture,signs", [
    (MCORE019, "common_state object"),   # 0.19: no common.pt
    (MCORE014, "common.pt"),
    (MCORE015, "MCoreMetadata"),
])
def test_validate_flags_a_megatron_core_save_without_metadata_json(tmp_path, fixture, signs):
    """Every version writes metadata.json last and refuses a directory without it; the DCP
    data left is not a valid plain DCP checkpoint either."""
    cut = tmp_path / "cut"
    shutil.copytree(next(fixture.glob("iter_*")), cut)
    (cut / "metadata.json").unlink()
    (cut / "integrity.json").unlink(missing_ok=True)
    result = runner.invoke(app, ["validate", str(cut), "--json"])
    assert result.exit_code == 1, result.output
    messages = [f["message"] for f in json.loads(result.stdout)["findings"]
                if f["file"] == "metadata.json"]
    assert len(messages) == 1 and "without metadata.json" in messages[0]
    assert signs in messages[0]


@pytest.mark.parametrize("fixture", [MCORE019, MCORE014])
def test_checkpoints_megatron_core_wrote_validate(fixture):
    result = validate(fixture)
    assert result.ok and not result.warnings, result.findings


def test_inspect_shows_the_019_common_state_as_the_common_state(tmp_path):
    result = inspect(MCORE019)
    assert result.common_items == ("common_state/shard_0_1",)
    assert not [o for o in result.meta.objects if o.key == "common_state"]
    assert result.meta.common["parallel"]["tp"] == 2
    doc = json.loads(runner.invoke(app, ["inspect", str(MCORE019), "--json"]).stdout)
    assert doc["common_items"] == ["common_state/shard_0_1"]
    assert "common_state" not in {o["key"] for o in doc["objects"]}
    text = runner.invoke(app, ["inspect", str(MCORE019)], env={"COLUMNS": "200"}).output
    assert "common state: the common_state object (the Megatron-Core 0.19 form)" in text


@pytest.mark.multiproc
def test_reshard_of_a_019_checkpoint_under_torchrun_keeps_its_form(tmp_path):
    """Two ranks, each writing its share: the common_state item is written once, by one rank,
    and the output equals one process's (but for .metadata's save id)."""
    import os
    import subprocess
    import sys

    from ckpt_tool.ops.diff import diff

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(repo), PYTHONWARNINGS="ignore")
    out = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "ckpt_tool", "reshard", str(MCORE019),
                           str(out), "--tp", "1", "--pp", "2"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_019_form(out)
    one = tmp_path / "one"
    reshard(MCORE019, one, ReshardRequest(tp=1, pp=2))
    d = diff(one, out)
    assert not (d.values or d.common or d.objects or d.only_in_a or d.only_in_b
                or d.objects_only_in_a or d.objects_only_in_b), d


def test_a_fresh_process_reshards_a_019_checkpoint_without_torch(tmp_path):
    """The common_state object read and written back without torch (``torch_save_object``),
    as common.pt is: the output loads with torch to the common state reshard means."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    code = ("import sys, json; from ckpt_tool.ops.reshard import reshard, ReshardRequest;"
            f"r = reshard({str(MCORE019)!r}, {str(out)!r},"
            " ReshardRequest(tp=1, drop_optimizer=True));"
            "print(json.dumps([r.written, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(
                              Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, False]
    _assert_019_form(out)
    with open_checkpoint(out) as r, open_checkpoint(MCORE019) as src:
        common, before = r.common(), src.common()
    assert common["args"].tensor_model_parallel_size == 1
    assert common["iteration"] == before["iteration"] == 10
    assert sorted(common) == sorted(before)
