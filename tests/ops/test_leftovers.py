"""What a killed run leaves beside its output is reported (validate, inspect — also when the
target does not exist) and reclaimed by a rerun; two runs cannot write one target at once."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.errors import CkptError, UsageError
from ckpt_tool.leftovers import (OLD_MARK, STAGING_MARK, leftovers, parked_previous,
                                 restore_command, target_lock)
from ckpt_tool.ops._output_staging import exchange
from ckpt_tool.ops.convert import ConvertOptions, convert

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2dp2_fp16opt"
runner = CliRunner()


def _killed_convert(out: Path, pause: Path) -> None:
    """A convert killed with SIGKILL while it writes: held at its first bytes written (a pause
    point of ``ckpt_tool._pause_points``), so the kill lands there however busy the machine."""
    pause.mkdir()
    env = dict(os.environ, CKPT_PAUSE_AT="writing", CKPT_PAUSE_DIR=str(pause))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(FIX), str(out),
                             "--to", "torch_dist"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 900  # a hang guard only: nothing is timed
    while not (pause / f"writing.{proc.pid}").exists():
        assert proc.poll() is None, "the convert ended before it wrote anything"
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("the convert never reached writing")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_a_killed_run_is_reported_and_the_rerun_reclaims_it(tmp_path):
    out = tmp_path / "out"
    _killed_convert(out, tmp_path / "pause")
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


def _parked(tmp_path: Path) -> tuple[Path, Path]:
    """What a run killed between the two renames of ``--overwrite`` leaves where the file
    system cannot exchange two paths: the target missing, the previous output parked in
    ``.out.ckpt-old-*/old``, the new one complete in its staging directory."""
    out = tmp_path / "out"
    convert(FIX, out, ConvertOptions(to="torch_dist"))
    parking = tmp_path / f".out{OLD_MARK}k1ll3d"
    parking.mkdir()
    os.rename(out, parking / "old")
    convert(FIX, tmp_path / "new", ConvertOptions(to="torch_dist"))
    os.rename(tmp_path / "new", tmp_path / f".out{STAGING_MARK}n3w")
    return out, parking / "old"


def test_a_parked_previous_output_is_named_with_the_command_that_restores_it(tmp_path):
    out, parked = _parked(tmp_path)
    assert parked_previous(out) == parked
    for cmd in ("validate", "inspect"):
        res = runner.invoke(app, [cmd, str(out)])
        line = " ".join(res.stderr.split())
        assert res.exit_code == 2 and "previous checkpoint" in line, line
        assert f"restore it with: mv {parked} {out}" in line, line
    subprocess.run(restore_command(parked, out), shell=True, check=True)  # as printed
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_the_next_run_restores_a_parked_output_before_it_can_fail(tmp_path):
    """The next run for the target fails (its source is damaged): the previous output is
    back in place, never deleted with the leftovers."""
    out, parked = _parked(tmp_path)
    before = sorted(p.name for p in parked.iterdir())
    bad = tmp_path / "bad"
    shutil.copytree(FIX / "iter_0000010", bad)
    data = sorted(bad.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CkptError):
        convert(bad, out, ConvertOptions(to="torch_dist"), overwrite=True)
    assert out.is_dir() and sorted(p.name for p in out.iterdir()) == before
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_without_overwrite_the_restored_output_is_kept(tmp_path):
    out, _ = _parked(tmp_path)
    with pytest.raises(UsageError, match="already exists"):
        convert(FIX, out, ConvertOptions(to="torch_dist"))
    assert leftovers(out) == [] and runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_overwrite_never_leaves_the_target_missing(tmp_path):
    """Where the file system exchanges two paths atomically, the old output and the new one
    swap in one step; elsewhere ``exchange`` says so and changes nothing."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "new").write_text("new")
    b.write_text("old")
    if exchange(a, b):
        assert (b / "new").read_text() == "new" and a.read_text() == "old"
    else:
        assert (a / "new").read_text() == "new" and b.read_text() == "old"


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
