"""What a command creates beside its output is its own: a symlink or a hard link planted at
the lock file's name (``.<name>.ckpt-lock``) is never followed, truncated or written; the
run refuses with one line naming it, and the file it points at is unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _cases import FIXTURE_BASES

from ckpt_tool.cli.app import app

runner = CliRunner()


def _plant(kind: str, lock: Path, victim: Path) -> None:
    if kind == "symlink":
        os.symlink(victim, lock)
    elif kind == "dangling symlink":
        os.symlink(victim.with_name("created-through-the-link"), lock)
    else:
        os.link(victim, lock)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "hard link"])
def test_a_link_at_the_lock_name_is_not_followed(tmp_path, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file\n")
    out = tmp_path / "out"
    lock = tmp_path / ".out.ckpt-lock"
    _plant(kind, lock, victim)
    r = runner.invoke(app, ["convert", str(FIXTURE_BASES["dcp"]), str(out), "--to",
                            "safetensors"])
    assert r.exit_code == 2, r.stderr
    assert r.stderr.count("\n") == 1 and ".out.ckpt-lock" in r.stderr, r.stderr
    assert victim.read_text() == "the user's file\n"
    assert not victim.with_name("created-through-the-link").exists()
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".out.ckpt-lock", "victim.txt"])


def test_the_lock_holder_is_named_or_not_at_all(tmp_path):
    """A second run meeting a held lock names the holder's pid, never ``pid ?``."""
    from ckpt_tool.errors import UsageError
    from ckpt_tool.leftovers import target_lock

    out = tmp_path / "out"
    with target_lock(out):
        with pytest.raises(UsageError) as err:
            with target_lock(out):
                pass
    assert f"(pid {os.getpid()})" in str(err.value)
    assert not (tmp_path / ".out.ckpt-lock").exists()


def test_a_holder_that_wrote_no_pid_yet_is_not_named_pid_question_mark(tmp_path):
    import fcntl

    from ckpt_tool.errors import UsageError
    from ckpt_tool.leftovers import target_lock

    out = tmp_path / "out"
    fd = os.open(tmp_path / ".out.ckpt-lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held, nothing written in it (yet)
        with pytest.raises(UsageError) as err:
            with target_lock(out):
                pass
    finally:
        os.close(fd)
    assert "another ckpt run is writing this output" in str(err.value)
    assert "pid ?" not in str(err.value)
