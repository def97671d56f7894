"""What a killed run leaves beside its output is reported (validate, inspect — also when the
target does not exist) and reclaimed by a rerun; two runs cannot write one target at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import UsageError
from ckpt_tool.leftovers import STAGING_MARK, leftovers, target_lock
from ckpt_tool.ops.convert import ConvertOptions, convert

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2dp2_fp16opt"
runner = CliRunner()


def _killed_convert(out: Path) -> None:
    """A convert killed with SIGKILL while it writes (its staging directory exists)."""
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(FIX), str(out),
                             "--to", "torch_dist"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not leftovers(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_killed_run_is_reported_and_the_rerun_reclaims_it(tmp_path):
    out = tmp_path / "out"
    for _ in range(5):  # the kill may land after the rename: retry until it leaves staging
        _killed_convert(out)
        if leftovers(out) and not out.exists():
            break
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    left = leftovers(out)
    assert left and STAGING_MARK in left[0].name and not out.exists()
    for cmd in (["validate", str(out)], ["inspect", str(out)]):
        res = runner.invoke(app, cmd)
        assert res.exit_code == 2
        assert "interrupted write left" in res.stderr and left[0].name in res.stderr
    result = convert(FIX, out, ConvertOptions(to="torch_dist"))
    assert any(n.startswith("reclaimed what an interrupted run left") for n in result.notes)
    assert leftovers(out) == [] and out.is_dir()
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_validate_warns_about_leftovers_beside_an_existing_checkpoint(tmp_path):
    out = tmp_path / "out"
    convert(FIX, out, ConvertOptions(to="torch_dist"))
    (tmp_path / f".out{STAGING_MARK}abc").mkdir()
    res = runner.invoke(app, ["validate", str(out), "--json"])
    assert res.exit_code == 0
    assert f".out{STAGING_MARK}abc" in res.stdout


def test_two_runs_cannot_write_one_target(tmp_path):
    out = tmp_path / "out"
    with target_lock(out):
        with pytest.raises(UsageError, match=f"pid {os.getpid()}"):
            convert(FIX, out, ConvertOptions(to="torch_dist"))
    assert not out.exists()
    convert(FIX, out, ConvertOptions(to="torch_dist"))  # the lock is gone with its holder
