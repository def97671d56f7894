"""Atomic outputs: staging beside the target, rename at the end, nothing left on failure."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_tool.errors import UsageError
from ckpt_tool.ops._output_staging import check_output_target, staged_output
from ckpt_tool.leftovers import STAGING_MARK


def test_output_appears_only_at_the_end(tmp_path):
    dst = tmp_path / "out"
    with staged_output(dst) as staging:
        (staging / "a.bin").write_bytes(b"x")
        assert not dst.exists()
        assert STAGING_MARK in staging.name and staging.parent == tmp_path
    assert (dst / "a.bin").read_bytes() == b"x"
    assert os.listdir(tmp_path) == ["out"]
    assert sorted(os.listdir(dst)) == ["a.bin", "ckpt-manifest.json"]  # its manifest inside


def test_failure_leaves_nothing(tmp_path):
    dst = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_output(dst) as staging:
            (staging / "a.bin").write_bytes(b"x")
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_and_single_file(tmp_path):
    dst = tmp_path / "model.pt"
    dst.write_bytes(b"old")
    with staged_output(dst, overwrite=True, file_name="model.pt") as staging:
        (staging / "model.pt").write_bytes(b"new")
    assert dst.read_bytes() == b"new"
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.ckpt-manifest.json"]


def test_check_output_target_refusals(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (tmp_path / "exists").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        check_output_target(tmp_path / "exists", sources=(src,))
    check_output_target(tmp_path / "exists", sources=(src,), overwrite=True)
    with pytest.raises(UsageError, match="inside the input"):
        check_output_target(src / "out", sources=(src,))
    with pytest.raises(UsageError, match="inside the input"):
        check_output_target(src, sources=(src,), overwrite=True)
    with pytest.raises(UsageError, match="contains the input"):
        check_output_target(tmp_path, sources=(src,), overwrite=True)
    with pytest.raises(UsageError, match="parent directory"):
        check_output_target(tmp_path / "no" / "out", sources=(src,))


def test_output_directory_follows_the_umask(tmp_path):
    import os
    import stat

    from ckpt_tool.ops.convert import ConvertOptions, convert

    src = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
    old = os.umask(0o002)
    try:
        convert(src, tmp_path / "out", ConvertOptions(to="torch_dist"))
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "out").stat().st_mode)
    assert mode == 0o775, oct(mode)  # was 0700 (mkdtemp) whatever the umask
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o664 for p in files)
