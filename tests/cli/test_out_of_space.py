"""A full file system (issue 15): one clean line, exit 2, nothing at the target that looks
complete, no staging left behind.

A 400 KiB tmpfs is mounted when the test runs as root and the mount works (containers often
allow it); elsewhere the same is provoked with a file size limit (``RLIMIT_FSIZE``, SIGXFSZ
ignored: writes fail with EFBIG) in a subprocess.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ckpt_tool.ops._output_staging as staging_mod
from ckpt_tool.cli.app import app

runner = CliRunner()
SRC = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
FORMATS = ("safetensors", "torch", "dcp", "torch_dist", "legacy", "zarr")


@pytest.fixture
def small_fs(tmp_path):
    """A 400 KiB tmpfs (every output of the source holds about 680 KB)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _nothing_left(parent: Path, name: str) -> None:
    assert sorted(os.listdir(parent)) == [], os.listdir(parent)  # no target, staging, lock


def _one_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error:"), result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.output
    return lines[0]


def test_too_small_file_system_is_refused_before_writing(small_fs):
    for to in ("safetensors", "torch_dist"):
        res = runner.invoke(app, ["convert", str(SRC), str(small_fs / "out"), "--to", to])
        assert res.exit_code == 2, res.output
        assert "not enough space for the output" in _one_line(res)
        _nothing_left(small_fs, "out")
    res = runner.invoke(app, ["reshard", str(SRC), str(small_fs / "rs"), "--tp", "1"])
    assert res.exit_code == 2 and "not enough space" in _one_line(res)
    _nothing_left(small_fs, "rs")


@pytest.mark.parametrize("to", FORMATS)
def test_disk_full_while_writing(small_fs, monkeypatch, to):
    """The space check passes (as when another process fills the disk meanwhile): the write
    itself runs out of space, in Python writers and in torch's C++ zip writer alike."""
    monkeypatch.setattr(staging_mod, "_check_space", lambda out, need: None)
    res = runner.invoke(app, ["convert", str(SRC), str(small_fs / "out"), "--to", to])
    assert res.exit_code == 2, res.output
    assert "no space left for the output" in _one_line(res)
    _nothing_left(small_fs, "out")


def _limited() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_file_size_limit(tmp_path, to):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "ckpt_tool", "convert", str(SRC), str(out),
                        "--to", to], capture_output=True, text=True, preexec_fn=_limited,
                       timeout=600)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "exceeds the file size limit" in lines[0], r.stderr
    assert os.listdir(tmp_path) == []
