"""A model part no layout rule knows: a dist target takes the split its source chunk grid shows
(the global tensor is what a dist checkpoint stores: the chunking moves no value), a per-rank
legacy target is refused naming the key (what each rank's module holds cannot be read off a
grid), exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.ops.diff import diff

FIX = Path(__file__).resolve().parents[2] / "fixtures"
PART = "decoder.layers.self_attention.my_mixer_proj."


def test_unknown_part(tmp_path):
    runner = CliRunner()
    src = tmp_path / "src"
    res = runner.invoke(app, ["convert", str(FIX / "mcore016_gpt_tp2pp2_fp32"), str(src), "--to",
                              "torch_dist", "--rename",
                              f"decoder.layers.self_attention.linear_proj.={PART}", "-q"])
    assert res.exit_code == 0, res.output
    legacy = tmp_path / "legacy"
    res = runner.invoke(app, ["reshard", str(src), str(legacy), "--tp", "1", "--pp", "1", "--to",
                              "legacy"])
    assert res.exit_code == 2 and not legacy.exists()
    assert f"'{PART}weight'" in res.stderr and "Traceback" not in res.output
    dist = tmp_path / "dist"
    res = runner.invoke(app, ["reshard", str(src), str(dist), "--tp", "1", "--pp", "1", "-q"])
    assert res.exit_code == 0, res.output
    assert diff(src, dist, resharded=True).identical
