"""A Megatron-LM save directory without ``latest_checkpointed_iteration.txt``: the commands read
its latest iteration and say which ones exist; ``--iteration N`` picks another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.save_dir import (LATEST_FILE, iteration_dirs, resolve_checkpoint_dir,
                                        select_iteration)

runner = CliRunner()
LEGACY = Path(__file__).resolve().parents[2] / "fixtures" / "megatron_legacy_tp2pp2"
DCP = LEGACY.parent / "dcp_plain"


@pytest.fixture
def one(tmp_path):
    """The fixture's save directory, its tracker file deleted."""
    save = Path(shutil.copytree(LEGACY, tmp_path / "one"))
    (save / LATEST_FILE).unlink()
    return save


@pytest.fixture
def two(one):
    """...with a second iteration (iter_0000020, a copy of iter_0000010)."""
    shutil.copytree(one / "iter_0000010", one / "iter_0000020")
    return one


def _inspect_root(*argv):
    result = runner.invoke(app, ["inspect", *map(str, argv), "--json"])
    assert result.exit_code == 0, result.output
    return Path(json.loads(result.stdout)["root"]).name, result.stderr


def test_library_takes_the_latest(two):
    assert [d.name for d in iteration_dirs(two)] == ["iter_0000010", "iter_0000020"]
    assert resolve_checkpoint_dir(two) == two / "iter_0000020"
    assert select_iteration(two, 10) == (two / "iter_0000010", None)
    path, note = select_iteration(two)
    assert path == two and "iterations: 10, 20" in note and "iter_0000020" in note


def test_no_tracker_one_iteration_is_read_with_a_note(one):
    root, err = _inspect_root(one)
    assert root == "iter_0000010"
    assert err.strip() == (f"note: {one}: no {LATEST_FILE}; iterations: 10; reading the latest, "
                           "iter_0000010 (--iteration N reads another)")


def test_no_tracker_two_iterations_default_latest_or_iteration(two):
    root, err = _inspect_root(two)
    assert root == "iter_0000020" and "iterations: 10, 20" in err
    root, err = _inspect_root(two, "--iteration", 10)
    assert root == "iter_0000010" and err == ""


def test_iteration_not_there_lists_them(two):
    result = runner.invoke(app, ["inspect", str(two), "--iteration", "30"])
    assert result.exit_code == 2
    assert result.stderr == (f"ckpt: error: {two}: no iteration 30 here (iterations: 10, 20) "
                             "(pick one of them with --iteration)\n")


def test_iteration_needs_a_save_directory():
    result = runner.invoke(app, ["inspect", str(DCP), "--iteration", "3"])
    assert result.exit_code == 2
    assert "is not a training save directory" in result.stderr
    assert result.stderr.count("\n") == 1


def test_iteration_dir_itself_with_its_number(two):
    root, _ = _inspect_root(two / "iter_0000010", "--iteration", 10)
    assert root == "iter_0000010"


def test_validate_warns_about_the_missing_tracker(two):
    result = runner.invoke(app, ["validate", str(two), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] and Path(doc["root"]).name == "iter_0000020"
    (f,) = doc["findings"]
    assert f["severity"] == "warning" and f["file"] == LATEST_FILE
    assert "iterations: 10, 20" in f["message"] and "iter_0000020" in f["message"]
    result = runner.invoke(app, ["validate", str(two), "--iteration", "10", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert Path(doc["root"]).name == "iter_0000010" and doc["findings"] == []


def test_convert_reshard_diff_take_iteration(two, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(two), str(out), "--to", "safetensors",
                                 "--iteration", "10"])
    assert result.exit_code == 0, result.output
    assert "iter_0000010" in result.stderr
    result = runner.invoke(app, ["reshard", str(two), "--tp", "1", "--check"])
    assert result.exit_code == 0, result.output
    assert "iterations: 10, 20" in result.stderr and "iter_0000020" in result.stderr
    result = runner.invoke(app, ["reshard", str(two), "--tp", "1", "--check", "--iteration",
                                 "10"])
    assert result.exit_code == 0 and "iter_0000010" in result.stderr
    result = runner.invoke(app, ["diff", str(two), str(LEGACY), "--iteration", "10",
                                 "--keys-only"])
    assert result.exit_code == 0, result.output
    assert "iter_0000010" in result.stderr.splitlines()[-1]
    # a side that is no save directory is read as given
    result = runner.invoke(app, ["diff", str(two), str(two / "iter_0000010"), "--iteration",
                                 "20", "--keys-only"])
    assert result.exit_code == 0, result.output
