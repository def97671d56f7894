"""Clean and right messages on inputs that are valid, or wrong in a way the user can fix:
an empty save is valid (a warning), a long output name works, a filter that leaves nothing
says so (not "a bug in ckpt")."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from _cases import FIXTURE_BASES

from ckpt_tool.cli.app import app

runner = CliRunner()


@pytest.fixture()
def empty_saves(tmp_path):
    """``dcp.save({})`` and ``save_file({})``: what the real libraries write for nothing."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    dcp.save({}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    save_file({}, str(tmp_path / "empty.safetensors"))
    return [tmp_path / "dcp", tmp_path / "empty.safetensors"]


def test_an_empty_save_is_valid(empty_saves, tmp_path):
    for src in empty_saves:
        r = runner.invoke(app, ["validate", str(src)])
        assert r.exit_code == 0 and "no tensors" in r.stdout + r.stderr, r.stdout + r.stderr
        for to in ("safetensors", "torch_dist"):
            out = tmp_path / f"out-{src.name}-{to}"
            r = runner.invoke(app, ["convert", str(src), str(out), "--to", to])
            assert r.exit_code == 0, r.stderr
        r = runner.invoke(app, ["diff", str(src), str(src)])
        assert r.exit_code == 0, r.stderr


def test_a_long_output_name_works(tmp_path):
    out = tmp_path / ("a" * 250)  # its lock / staging names would exceed 255 bytes
    for extra in ([], ["--overwrite"]):
        r = runner.invoke(app, ["convert", str(FIXTURE_BASES["dcp"]), str(out), "--to",
                                "safetensors", *extra])
        assert r.exit_code == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_filter_that_leaves_nothing_says_so(tmp_path):
    r = runner.invoke(app, ["convert", str(FIXTURE_BASES["dcp"]), str(tmp_path / "o"), "--to",
                            "safetensors", "--filter", "^nothing-matches$"])
    assert r.exit_code == 2 and "leave none of the" in r.stderr, r.stderr
    assert "bug" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("text", ["\u00b2", "9" * 5000, "1" * 19])
def test_a_tracker_that_is_no_int64_is_one_clean_line(tmp_path, text):
    import shutil

    save = tmp_path / "save"
    shutil.copytree(FIXTURE_BASES["legacy"], save)
    (save / "latest_checkpointed_iteration.txt").write_text(text + "\n")
    r = runner.invoke(app, ["inspect", str(save)])
    assert r.exit_code == 2 and r.stderr.startswith("ckpt: error: "), r.stderr
    assert "internal error" not in r.stderr and r.stderr.count("\n") == 1
