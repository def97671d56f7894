"""Bad input gets a clear answer from ``inspect`` and ``validate``: the exit code, ONE line on
stderr naming the path and the problem, never a traceback.

inspect exits 2 for every unreadable input. validate follows its documented rule: 2 when the
input cannot be read at all (missing, not a checkpoint, a symlink loop, no permission), 1 when
it is recognisably a checkpoint but broken (truncated/garbage ``.metadata``, a bad
``metadata.json``, a tracker file with garbage content).
"""

import builtins
import errno
import io
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
DCP = FIXTURES / "dcp_plain"
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

pytestmark = pytest.mark.skipif(not MCORE.is_dir() or not DCP.is_dir(),
                                reason="fixtures not generated")


def _check(cmd, path, code, *needles, where=None):
    """Run ``ckpt cmd path``; exactly one stderr line, naming ``where`` and every needle."""
    result = runner.invoke(app, [cmd, str(path)])
    assert result.exit_code == code, (cmd, result.output)
    assert "Traceback" not in result.output, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, (cmd, result.stderr)
    line = lines[0]
    assert str(where if where is not None else path) in line, line
    for n in needles:
        assert n in line, (n, line)
    if code == 2:
        assert line.startswith("ckpt: error: ")
    return line


@pytest.fixture
def mcore(tmp_path):
    return Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))


@pytest.fixture
def dcp(tmp_path):
    return Path(shutil.copytree(DCP, tmp_path / "dcp"))


CMDS = ["inspect", "validate"]


@pytest.mark.parametrize("cmd", CMDS)
def test_empty_dir(tmp_path, cmd):
    (tmp_path / "empty").mkdir()
    _check(cmd, tmp_path / "empty", 2, "not a checkpoint")


@pytest.mark.parametrize("cmd", CMDS)
def test_random_file_instead_of_dir(tmp_path, cmd):
    f = tmp_path / "random.bin"
    f.write_bytes(os.urandom(4096))
    _check(cmd, f, 2, "not a checkpoint")


@pytest.mark.parametrize("cmd", CMDS)
def test_missing(tmp_path, cmd):
    _check(cmd, tmp_path / "nope", 2, "no such file or directory")


@pytest.mark.parametrize("cmd", CMDS)
def test_fifo_does_not_hang(tmp_path, cmd):
    os.mkfifo(tmp_path / "pipe")
    _check(cmd, tmp_path / "pipe", 2, "a FIFO (named pipe), not a regular file")


# -- permissions ------------------------------------------------------------------------------

def _deny(monkeypatch, victim: Path):
    """Root ignores permissions: make every open/scandir of ``victim`` (or below) fail with
    EACCES in-process, as it does for other users on a ``chmod 000`` path."""
    victim = str(victim)

    def denied(p):
        try:
            s = os.fspath(p)
        except TypeError:
            return False
        s = s.decode() if isinstance(s, bytes) else s
        return s == victim or s.startswith(victim + os.sep)

    def wrap(fn):
        def inner(p, *a, **k):
            if denied(p):
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))
            return fn(p, *a, **k)
        return inner

    monkeypatch.setattr(builtins, "open", wrap(builtins.open))
    monkeypatch.setattr(io, "open", wrap(io.open))
    monkeypatch.setattr(os, "open", wrap(os.open))
    monkeypatch.setattr(os, "scandir", wrap(os.scandir))
    monkeypatch.setattr(os, "listdir", wrap(os.listdir))


@pytest.mark.parametrize("cmd", CMDS)
@pytest.mark.parametrize("mode", [0o000, 0o600])  # nothing / read without search (x)
def test_unreadable_dir(mcore, cmd, mode, monkeypatch):
    if ROOT:
        _deny(monkeypatch, mcore)
    os.chmod(mcore, mode)
    try:
        _check(cmd, mcore, 2, "permission denied")
    finally:
        os.chmod(mcore, 0o755)


@pytest.mark.parametrize("cmd", CMDS)
def test_unreadable_metadata_file(mcore, cmd, monkeypatch):
    if ROOT:
        _deny(monkeypatch, mcore / ".metadata")
    os.chmod(mcore / ".metadata", 0o000)
    try:
        _check(cmd, mcore, 2, "permission denied", where=mcore / ".metadata")
    finally:
        os.chmod(mcore / ".metadata", 0o644)


@pytest.mark.skipif(ROOT, reason="root ignores file permissions (simulated above)")
@pytest.mark.parametrize("cmd", CMDS)
def test_unreadable_dir_real_permissions(mcore, cmd):
    os.chmod(mcore, 0o000)
    try:
        _check(cmd, mcore, 2, "permission denied")
    finally:
        os.chmod(mcore, 0o755)


@pytest.mark.skipif(not ROOT or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the CLI as another user")
@pytest.mark.parametrize("cmd", CMDS)
@pytest.mark.parametrize("mode", [0o000, 0o744])
def test_unreadable_dir_as_another_user(cmd, mode):
    """Real permissions, as root: run the installed CLI as ``nobody``."""
    import subprocess
    import sys
    import tempfile

    exe = Path(sys.executable).with_name("ckpt")
    if not exe.exists():
        pytest.skip("ckpt console script not installed next to the interpreter")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*as_nobody, str(exe), "--version"], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0:  # e.g. the checkout lives under a 0700 directory
        pytest.skip(f"nobody cannot run {exe}: {probe.stderr.strip()[:200]}")
    base = Path(tempfile.mkdtemp(prefix="ckpt-perm-"))
    try:
        os.chmod(base, 0o755)
        ck = Path(shutil.copytree(MCORE, base / "ck"))
        for f in [ck, *ck.iterdir()]:
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(ck, mode)
        r = subprocess.run([*as_nobody, str(exe), cmd, str(ck)], capture_output=True,
                           text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
        assert lines[0].startswith(f"ckpt: error: {ck}") and "permission denied" in lines[0]
    finally:
        os.chmod(base / "ck", 0o755)
        shutil.rmtree(base)


# -- damaged metadata -------------------------------------------------------------------------

def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


DAMAGE = {
    "truncated": (_truncate, "cannot unpickle"),
    "zero-length": (lambda f: f.write_bytes(b""), "empty"),
    "garbage": (lambda f: f.write_bytes(os.urandom(1000)), "cannot unpickle"),
}


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("which", ["mcore", "dcp"])
def test_damaged_dot_metadata(request, which, kind):
    ck = request.getfixturevalue(which)
    damage, words = DAMAGE[kind]
    damage(ck / ".metadata")
    _check("inspect", ck, 2, ".metadata", words, where=ck)
    line = _check("validate", ck, 1, "INVALID", ".metadata", words, where=ck)
    assert "first error" in line


@pytest.mark.parametrize("content", ['{"sharded_backend": ', "[1, 2]", '{"sharded_backend": 5}',
                                     "", "\xff\xfe garbage"])
def test_wrong_metadata_json(mcore, content):
    (mcore / "metadata.json").write_bytes(content.encode("latin-1"))
    _check("inspect", mcore, 2, "metadata.json")
    _check("validate", mcore, 1, "INVALID", "metadata.json")


# -- symlink loops ----------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", CMDS)
def test_symlink_loop_as_the_path(tmp_path, cmd):
    os.symlink(tmp_path / "b", tmp_path / "a")
    os.symlink(tmp_path / "a", tmp_path / "b")
    _check(cmd, tmp_path / "a", 2, "symlink loop")


@pytest.mark.parametrize("cmd", CMDS)
def test_symlink_loop_as_the_metadata_file(mcore, cmd):
    (mcore / ".metadata").unlink()
    os.symlink(mcore / ".metadata", mcore / ".metadata")
    _check(cmd, mcore, 2, "symlink loop", where=mcore / ".metadata")


@pytest.mark.parametrize("cmd", CMDS)
def test_stray_symlink_loop_inside_is_harmless(mcore, cmd):
    os.symlink(mcore / "y", mcore / "x")
    os.symlink(mcore / "x", mcore / "y")
    result = runner.invoke(app, [cmd, str(mcore)])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("cmd", CMDS)
def test_broken_symlink(tmp_path, cmd):
    os.symlink(tmp_path / "gone", tmp_path / "link")
    _check(cmd, tmp_path / "link", 2, "broken symlink")


# -- tracker file -----------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"zz%%garbage\n", b"\x00\xff\x80" * 10, b""])
def test_tracker_with_garbage(tmp_path, content):
    save = tmp_path / "save"
    shutil.copytree(MCORE, save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_bytes(content)
    _check("inspect", save, 2, "latest_checkpointed_iteration.txt", "not an iteration number")
    _check("validate", save, 1, "INVALID", "latest_checkpointed_iteration.txt",
           "not an iteration number")


@pytest.mark.parametrize("cmd", CMDS)
@pytest.mark.parametrize("where, kind", [(MCORE, "Megatron-Core torch_dist checkpoint"),
                                         (DCP, "PyTorch DCP checkpoint")])
def test_one_distcp_file_is_named_as_a_data_file(cmd, where, kind):
    """A ``*.distcp`` file alone is one data file of its directory's checkpoint, not a
    1-tensor torch.save file: the line says so and points at the directory."""
    f = sorted(where.glob("*.distcp"))[0]
    line = _check(cmd, f, 2, "one data file of a " + kind, "not a checkpoint by itself",
                  f"pass the checkpoint directory: {where}")
    assert "torch" not in line.split(": ")[0]


@pytest.mark.parametrize("cmd", CMDS)
def test_one_distcp_file_without_metadata_beside_it(tmp_path, cmd):
    f = Path(shutil.copy(sorted(DCP.glob("*.distcp"))[0], tmp_path / "__0_0.distcp"))
    _check(cmd, f, 2, "one data file of a DCP/torch_dist checkpoint",
           "no .metadata", f"pass the checkpoint directory: {tmp_path}")


def test_one_distcp_file_for_convert_and_diff(tmp_path):
    f = sorted(DCP.glob("*.distcp"))[0]
    for argv in (["convert", str(f), str(tmp_path / "out"), "--to", "safetensors"],
                 ["diff", str(f), str(DCP)]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 2
        assert "one data file of a PyTorch DCP checkpoint" in result.stderr
        assert not (tmp_path / "out").exists()
