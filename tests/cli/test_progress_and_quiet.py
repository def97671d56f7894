"""Progress bars on a terminal (``validate`` too, ``--deep`` included), ``--quiet`` and
``--no-progress``, and ``--debug`` after the command's name."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

sys.path.insert(0, str(Path(__file__).parent))
from _terminal import drain_terminal  # noqa: E402

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "fixtures"
DCP = FIX / "dcp_plain"
ZARR = FIX / "mcore015_zarr_gpt_tp2pp2"
OPTIM = FIX / "mcore016_gpt_tp2pp2_bf16_optim"
BAR = "━"  # Rich's bar
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _bar_lines(term: str) -> list[str]:
    """Every form of the bar the terminal drew (colours dropped)."""
    return [part for line in ANSI.sub("", term).split("\n") for part in line.split("\r")
            if BAR in part]


def _on_a_terminal(*args: str, columns: int = 120) -> tuple[int, str, str]:
    """``python -m ckpt_tool ARGS`` with stderr on a pseudo-terminal (stdout a pipe): the exit
    code, stdout and what the terminal received."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *args], cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    term = drain_terminal(master)
    out = proc.stdout.read().decode()
    proc.wait(timeout=120)
    return proc.returncode, out, term.decode(errors="replace")


def test_validate_deep_draws_a_bar_of_files_scanned():
    code, out, term = _on_a_terminal("validate", str(DCP), "--deep", "--json")
    assert code == 0 and out.lstrip().startswith("{")
    assert BAR in term and "validate" in term and "2/2 files" in term
    assert "valid:" in term


def test_validate_deep_draws_a_bar_of_tensors_read():
    code, _, term = _on_a_terminal("validate", str(ZARR), "--deep")
    assert code == 0
    assert BAR in term and "16/16 tensors" in term


@pytest.mark.parametrize("flag", ["--no-progress", "--quiet", "-q"])
def test_no_bar_with_no_progress_or_quiet(flag):
    code, _, term = _on_a_terminal("validate", str(DCP), "--deep", flag)
    assert code == 0 and BAR not in term
    if flag == "--no-progress":
        assert "valid:" in term
    else:
        assert term.strip() == ""  # quiet: nothing but errors


def test_convert_no_progress_and_quiet(tmp_path):
    code, _, term = _on_a_terminal("convert", str(DCP), str(tmp_path / "a"), "--to",
                                   "safetensors")
    assert code == 0 and BAR in term and "converted" in term
    code, _, term = _on_a_terminal("convert", str(DCP), str(tmp_path / "b"), "--to",
                                   "safetensors", "--no-progress")
    assert code == 0 and BAR not in term and "converted" in term
    code, _, term = _on_a_terminal("convert", str(DCP), str(tmp_path / "c"), "--to",
                                   "safetensors", "--quiet")
    assert code == 0 and term.strip() == ""
    assert (tmp_path / "c").is_dir()


def test_quiet_keeps_the_verdict_of_a_failure_and_errors(tmp_path):
    import shutil

    ck = Path(shutil.copytree(DCP, tmp_path / "ck"))
    victim = sorted(ck.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    result = runner.invoke(app, ["validate", str(ck), "-q"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("INVALID:")
    result = runner.invoke(app, ["validate", str(tmp_path / "missing"), "--quiet"])
    assert result.exit_code == 2 and result.stderr.startswith("ckpt: error:")
    # and a later run without --quiet speaks again
    assert "valid:" in runner.invoke(app, ["validate", str(DCP)]).stderr


@pytest.mark.parametrize("cmd", ["validate", "convert", "diff", "reshard"])
def test_commands_with_progress_take_both_flags(cmd):
    text = runner.invoke(app, [cmd, "--help"]).stdout
    assert "--quiet" in text and "-q" in text and "--no-progress" in text


def test_diff_quiet(tmp_path):
    result = runner.invoke(app, ["diff", str(DCP), str(DCP), "--quiet"])
    assert result.exit_code == 0 and result.stderr == ""
    result = runner.invoke(app, ["diff", str(DCP), str(DCP), "--no-progress"])
    assert result.exit_code == 0 and result.stderr.startswith("identical:")


@pytest.mark.parametrize("argv", [["--debug", "validate", "{missing}"],
                                  ["validate", "{missing}", "--debug"],
                                  ["inspect", "{missing}", "--debug"],
                                  ["diff", "{missing}", "{missing}", "--debug"]])
def test_debug_before_or_after_the_command(tmp_path, argv):
    argv = [a.format(missing=tmp_path / "missing") for a in argv]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("ckpt: error:")
    # without it, one line (the state does not leak into the next run)
    result = runner.invoke(app, [a for a in argv if a != "--debug"])
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_debug_after_the_command_through_the_program(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", "validate",
                           str(tmp_path / "missing"), "--debug"], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_library_validate_reports_progress_per_pass():
    from ckpt_tool.ops.validate import validate

    class Sink:
        def __init__(self):
            self.passes = []

        def start(self, total_bytes, total, unit="tensor"):
            self.passes.append([unit, total_bytes, total, 0, 0])

        def update(self, nbytes, done):
            self.passes[-1][3] += nbytes
            self.passes[-1][4] = done

    sink = Sink()
    assert validate(ZARR, deep=True, progress=sink).ok
    assert [p[0] for p in sink.passes] == ["tensor"]
    unit, total_bytes, total, seen, done = sink.passes[0]
    assert seen == total_bytes > 0 and done == total == 16
    sink = Sink()
    assert validate(DCP, deep=True, progress=sink).ok
    assert [(p[0], p[2], p[4]) for p in sink.passes] == [("file", 2, 2)]
    assert sink.passes[0][1] == sink.passes[0][3] > 0


@pytest.mark.parametrize("to", [None, "legacy"])
def test_reshard_bar_counts_tensors_to_the_end(tmp_path, to):
    extra = ["--to", "legacy", "--drop-optimizer"] if to else []
    code, _, term = _on_a_terminal("reshard", str(OPTIM), str(tmp_path / "o"), "--tp", "1",
                                   "--pp", "1", *extra)
    assert code == 0, term
    last = _bar_lines(term)[-1]
    total = 16 if to else 64  # (legacy: the model's tensors; dist: the optimizer's too)
    assert f"{total}/{total} tensors" in last, last


@pytest.mark.parametrize("columns", [60, 80, 120])
@pytest.mark.parametrize("cmd", ["convert", "validate", "reshard", "diff"])
def test_bars_fit_the_terminal_and_show_a_rate_or_nothing(tmp_path, cmd, columns):
    argv = {"convert": ["convert", str(OPTIM), str(tmp_path / "o"), "--to", "torch_dist"],
            "validate": ["validate", str(OPTIM)],
            "reshard": ["reshard", str(OPTIM), str(tmp_path / "o"), "--tp", "1"],
            "diff": ["diff", str(OPTIM), str(OPTIM)]}[cmd]
    code, _, term = _on_a_terminal(*argv, columns=columns)
    assert code == 0, term
    bars = _bar_lines(term)
    assert bars, term
    for line in bars:
        assert len(line.rstrip()) <= columns, line
        assert "?" not in line, line  # a rate, or nothing
    last = bars[-1]
    unit = "files" if cmd == "validate" else "tensors"
    assert re.search(rf"\b(\d+)/\1 {unit}", last), last  # counted to the end
    if columns >= 80:
        assert "/s" in last, last
