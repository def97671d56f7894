"""``reshard``/``convert`` keep the source's container (a training save directory gives one, an
iteration directory gives one inside DST, a bare checkpoint a bare one) and end with the recipe
to resume from the output; bad containers are one line, exit 2, nothing written
(docs/resume.md). Megatron-LM itself resuming with the recipe:
tests/peer/test_training_checkpointing.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.save_dir import LATEST_FILE

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"
BUCKETED = FIX / "mcore016_gpt_tp2dp2_distopt_buckets"  # iteration 10, DistributedOptimizer
MODEL_ONLY = FIX / "mcore016_gpt_tp2pp2_modelonly"
LEGACY = FIX / "megatron_legacy_tp2pp2"


def _ok(*argv: object) -> object:
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == 0, result.output
    return result


def _refused(*argv: object) -> str:
    result = runner.invoke(app, [str(a) for a in argv])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def _nothing_written(parent: Path, *names: str) -> None:
    assert not [p.name for p in parent.iterdir() if ".ckpt-staging-" in p.name
                or p.name in names]


def test_a_save_directory_gives_a_save_directory_and_the_recipe(tmp_path):
    out = tmp_path / "tp1"
    result = _ok("reshard", BUCKETED, out, "--tp", "1", "--workers", "2")
    assert (out / LATEST_FILE).read_text() == "10"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000010", LATEST_FILE]
    assert (out / "iter_0000010" / "integrity.json").is_file()  # the checkpoint's own
    _ok("validate", out)
    lines = result.stderr.strip().splitlines()
    recipe = lines.index(next(x for x in lines if x.startswith("resume with Megatron-LM:")))
    assert lines[recipe - 1].startswith("resharded ")  # the verdict, then the recipe, last
    assert lines[recipe] == (f"resume with Megatron-LM: --load {out} "
                             "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
                             "--no-load-rng")
    assert lines[-1] == (
        f"resume with dist_checkpointing: d = '{out}/iter_0000010'; md = dist_checkpointing."
        "load_content_metadata(d); sd = {'model': model.sharded_state_dict(metadata=md)}; "
        "sd['optimizer'] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=md); "
        "dist_checkpointing.load(sd, d)")
    # --json: the same as data; -q: none of it
    result = _ok("reshard", BUCKETED, tmp_path / "j", "--tp", "1", "--json", "-q")
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["container"] == {"kind": "save_dir", "iteration_dir": "iter_0000010",
                                "tracker": "10", "framework": "megatron_lm"}
    assert doc["resume"]["framework"] == "megatron_lm" and doc["resume"]["overrides"] == []
    assert doc["resume"]["megatron_lm"] == [
        "--load", str(tmp_path / "j"), "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--no-load-rng"]
    assert doc["resume"]["dist_checkpointing"].startswith(f"d = '{tmp_path / 'j'}/iter_0000010'")


def test_iteration_picks_and_iteration_and_bare_checkpoints_keep_their_form(tmp_path):
    save = Path(shutil.copytree(MODEL_ONLY, tmp_path / "save"))
    shutil.copytree(save / "iter_0000010", save / "iter_0000020")  # the tracker says 10
    # --iteration N: that iteration, with a tracker naming it
    doc = json.loads(_ok("convert", save, tmp_path / "at20", "--to", "torch_dist",
                         "--iteration", "20", "--json").stdout)
    assert (tmp_path / "at20" / LATEST_FILE).read_text() == "20"
    assert [p.name for p in (tmp_path / "at20").glob("iter_*")] == ["iter_0000020"]
    assert doc["resume"]["megatron_lm"][:2] == ["--load", str(tmp_path / "at20")]
    assert "--no-load-optim" in doc["resume"]["megatron_lm"]  # a model-only checkpoint
    assert "optimizer.sharded_state_dict" not in doc["resume"]["dist_checkpointing"]
    # an iteration directory: the same name inside DST, no tracker (--ckpt-step picks it)
    out = tmp_path / "it"
    doc = json.loads(_ok("convert", save / "iter_0000020", out, "--to", "torch_dist",
                         "--json").stdout)
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000020"]
    assert doc["resume"]["megatron_lm"][:4] == ["--load", str(out), "--ckpt-step", "20"]
    # a bare checkpoint: a bare one, and how to make a save directory of it
    bare = Path(shutil.copytree(save / "iter_0000010", tmp_path / "bare"))
    out = tmp_path / "b"
    result = _ok("reshard", bare, out, "--tp", "1", "--pp", "2")
    assert (out / "metadata.json").is_file() and not (out / LATEST_FILE).exists()
    assert f"mv {out} {out}-save/iter_0000010 && echo 10 > {out}-save/{LATEST_FILE}" \
        in result.stderr
    assert "resume with Megatron-LM: --tensor-model-parallel-size 1 " \
        "--pipeline-model-parallel-size 2 --no-load-rng --no-load-optim" in result.stderr
    # formats Megatron-LM does not resume from are bare, without a recipe
    doc = json.loads(_ok("convert", save, tmp_path / "d", "--to", "dcp", "--json").stdout)
    assert doc["container"]["kind"] == "bare" and doc["resume"] is None
    assert (tmp_path / "d" / ".metadata").is_file()


def test_format_changes_name_ckpt_format_and_what_was_left_out(tmp_path):
    # legacy -> torch_dist: the loader changes; the per-rank RNG states stay behind
    doc = json.loads(_ok("reshard", LEGACY, tmp_path / "dist", "--tp", "1", "--pp", "1",
                         "--to", "torch_dist", "--json").stdout)
    flags = doc["resume"]["megatron_lm"]
    assert flags[:2] == ["--load", str(tmp_path / "dist")]
    assert flags[flags.index("--ckpt-format") + 1] == "torch_dist" and "--no-load-rng" in flags
    assert (tmp_path / "dist" / LATEST_FILE).read_text() == "10"
    # torch_dist -> legacy rank files: the other loader, no optimizer state
    doc = json.loads(_ok("reshard", MODEL_ONLY, tmp_path / "leg", "--tp", "1", "--to",
                         "legacy", "--json").stdout)
    flags = doc["resume"]["megatron_lm"]
    assert flags[flags.index("--ckpt-format") + 1] == "torch"
    assert "--no-load-optim" in flags and "--no-load-rng" in flags
    assert doc["resume"]["dist_checkpointing"] is None
    assert sorted(p.name for p in (tmp_path / "leg").iterdir()) == \
        ["ckpt-manifest.json", "iter_0000010", LATEST_FILE]


def test_bad_containers_are_one_line_and_write_nothing(tmp_path):
    save = Path(shutil.copytree(MODEL_ONLY, tmp_path / "save"))
    # the tracker names an iteration that is not there
    (save / LATEST_FILE).write_text("20")
    line = _refused("reshard", save, tmp_path / "out", "--tp", "1")
    assert "names iteration 20 but iter_0000020/ is missing" in line
    line = _refused("convert", save, tmp_path / "out", "--to", "torch_dist")
    assert "iter_0000020/ is missing" in line
    _nothing_written(tmp_path, "out")
    (save / LATEST_FILE).write_text("10")
    # DST inside the save directory, DST existing, DST named as the iteration directory
    assert "inside the input" in _refused("reshard", save, save / "tp1", "--tp", "1")
    _nothing_written(save, "tp1")
    (tmp_path / "there").mkdir()
    assert "already exists" in _refused("reshard", save, tmp_path / "there", "--tp", "1")
    assert not any((tmp_path / "there").iterdir())
    line = _refused("reshard", save, tmp_path / "iter_0000010", "--tp", "1")
    assert "named as an iteration directory" in line
    _nothing_written(tmp_path, "iter_0000010")


@pytest.mark.parametrize("to", ["torch_dist", "legacy"])
def test_overwrite_replaces_the_whole_save_directory(tmp_path, to):
    out = tmp_path / "out"
    out.mkdir()
    (out / "iter_0000005").mkdir()
    (out / LATEST_FILE).write_text("5")
    _ok("reshard", MODEL_ONLY, out, "--tp", "1", "--to", to, "--overwrite", "-q")
    assert (out / LATEST_FILE).read_text() == "10"
    assert not (out / "iter_0000005").exists()  # DST is replaced as a whole


def test_recipe_variants():
    """The recipe as a library result for what the commands above do not write."""
    from ckpt_tool.formats.save_dir import Container
    from ckpt_tool.ops._resume import ResumeFacts, resume_recipe

    def layout(tp, pp, ep=1, etp=None, vpp=None, first=None):
        return {"tp": tp, "pp": pp, "ep": ep, "etp": etp or tp, "vpp": vpp,
                "first_stage_layers": first, "last_stage_layers": None}

    out, save = Path("/ckpt/o"), Container("save_dir", "iter_0000010")
    moe = resume_recipe(ResumeFacts(out, save, "torch_dist", "torch_dist", True, True,
                                    "fully_reshardable", 10, layout(2, 2, 4, 1),
                                    layout(1, 1, 2, vpp=2, first=3)))
    assert moe.megatron_lm == ["--load", "/ckpt/o", "--tensor-model-parallel-size", "2",
                               "--pipeline-model-parallel-size", "2",
                               "--expert-model-parallel-size", "4",
                               "--expert-tensor-parallel-size", "1"]
    notes = " | ".join(moe.notes)
    assert "2 virtual pipeline stages" in notes and "--decoder-first-pipeline-num-layers" in notes
    assert "a multiple of 8" in notes
    vpp = resume_recipe(ResumeFacts(out, save, "legacy", "legacy", False, True, None, 10,
                                    layout(1, 2, vpp=2), layout(1, 2, vpp=2)))
    assert vpp.megatron_lm[-3:] == ["--num-virtual-stages-per-pipeline-rank", "2",
                                    "--no-load-optim"]
    assert vpp.dist_checkpointing is None
    release = resume_recipe(ResumeFacts(out, Container("iteration_dir", "release"), "torch_dist",
                                        "torch_dist", True, True, "dp_zero_gather_scatter"))
    assert release.megatron_lm == []  # a tracker file is needed first: the note says it
    assert "echo release > /ckpt/o/latest_checkpointed_iteration.txt" in release.notes[0]
    assert "--ckpt-fully-parallel-load" in release.notes[1]
    kept = resume_recipe(ResumeFacts(out, Container("save_dir", "release"), "zarr", "zarr",
                                     True, True, "dp_reshardable"))
    assert kept.megatron_lm == ["--load", "/ckpt/o"]
    assert [n.split(":")[0] for n in kept.notes] == [
        "a release checkpoint", "optimizer state dp_reshardable",
        "Megatron-Core 0.16 and later cannot load zarr (0.15 and earlier, with zarr installed, can)"]
    assert resume_recipe(ResumeFacts(out, Container(), "torch_dist", "safetensors", True,
                                     True)) is None
