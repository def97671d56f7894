"""``ckpt inspect DIR`` on a folder of checkpoints lists them (path, format, iterations,
layout, size, manifest), at any depth up to a few levels; a directory with no checkpoint is
one short error line with the hint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.ops.inspect import checkpoints_under

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"


def _runs(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    shutil.copytree(FIX / "mcore016_gpt_tp2pp2_fp32", runs / "gpt" / "save")  # 2 levels down
    shutil.copytree(FIX / "dcp_plain", runs / "dcp")
    (runs / "logs").mkdir()
    (runs / "logs" / "train.log").write_text("not a checkpoint\n")
    return runs


def test_a_runs_folder_lists_its_checkpoints(tmp_path):
    runs = _runs(tmp_path)
    res = runner.invoke(app, ["inspect", str(runs)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == f"2 checkpoints in {runs}"
    assert lines[1].split() == ["path", "format", "iterations", "layout", "size", "manifest"]
    assert lines[2].split()[:2] == ["dcp/", "dcp"]
    assert lines[3].split()[:6] == ["gpt/save/", "torch_dist", "iter_0000010", "tp2", "pp2",
                                    "ep1"]
    assert "not a checkpoint" not in res.stderr
    doc = json.loads(runner.invoke(app, ["inspect", str(runs), "--json"]).stdout)
    assert [c["path"] for c in doc["checkpoints"]] == ["dcp/", "gpt/save/"]
    save = doc["checkpoints"][1]
    assert save["iterations"] == ["iter_0000010"] and save["layout"] == {"tp": 2, "pp": 2,
                                                                          "ep": 1}
    assert save["bytes"] == sum(f.stat().st_size for f in (runs / "gpt" / "save").rglob("*")
                                if f.is_file())
    assert save["manifest"] is False


def test_the_fixtures_folder_lists_the_fixtures():
    found = {c["path"]: c for c in checkpoints_under(FIX)}
    assert found["mcore016_gpt_tp2pp2_fp32/"]["format"] == "torch_dist"
    assert found["megatron_legacy_tp2pp2/"]["format"] == "legacy"
    assert found["mcore019_gpt_tp2dp2_distopt_buckets/"]["manifest"] is True


def test_a_folder_with_no_checkpoint_is_one_short_line(tmp_path):
    (tmp_path / "empty" / "a" / "b").mkdir(parents=True)
    res = runner.invoke(app, ["inspect", str(tmp_path / "empty")])
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and len(lines[0]) - len(str(tmp_path)) < 160, lines
    assert "none in it" in lines[0] and "training save directory" in lines[0]
