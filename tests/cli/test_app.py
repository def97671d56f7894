"""The root command: help lists every subcommand, each with its own help; shell completion."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool import __version__
from ckpt_tool.cli.app import app

runner = CliRunner()
COMMANDS = ["inspect", "validate", "reshard", "convert", "diff"]


def test_help_lists_the_five_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(name):
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0
    assert result.output.strip()


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["inspect", "/nonexistent"], 2)])
def test_under_a_process_group_main_leaves_through_exit_cleanly(monkeypatch, argv, code):
    """gloo's threads can abort a normal interpreter exit ("terminate called without an active
    exception"): with a process group, ``ckpt`` ends in ``exit_cleanly`` with its exit code."""
    import sys

    import ckpt_tool._torchrun as tr
    from ckpt_tool.cli import app as app_module

    left = []

    def fake_exit(c):
        left.append(c)
        raise SystemExit(c)

    monkeypatch.setattr(tr, "group_initialized", lambda: True)
    monkeypatch.setattr(tr, "exit_cleanly", fake_exit)
    monkeypatch.setattr(sys, "argv", ["ckpt", *argv])
    with pytest.raises(SystemExit):
        app_module.main()
    assert left == [code]


def test_without_a_process_group_main_exits_as_usual(monkeypatch):
    import sys

    from ckpt_tool.cli import app as app_module

    monkeypatch.setattr(sys, "argv", ["ckpt", "inspect", "/nonexistent"])
    with pytest.raises(SystemExit) as exc:
        app_module.main()
    assert exc.value.code == 2


def test_shell_completion_is_offered(monkeypatch):
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout
    # typer detects the user's shell from the parent processes (none under a CI runner)
    import shellingham

    monkeypatch.setattr(shellingham, "detect_shell", lambda *a, **k: ("bash", "/bin/bash"))
    result = runner.invoke(app, ["--show-completion"])
    assert result.exit_code == 0 and "_CKPT_COMPLETE=complete_bash" in result.stdout


@pytest.mark.parametrize("words, cword, expected", [
    ("ckpt val", 1, ["validate"]),
    ("ckpt validate x --de", 3, ["--deep", "--debug"]),
    ("ckpt convert a b --to s", 5, ["safetensors"]),
    ("ckpt reshard a --to ", 4, ["torch_dist", "legacy"]),
])
def test_shell_completion_answers(words, cword, expected):
    """What bash gets from ``ckpt`` (the script of --show-completion asks this way)."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "_CKPT_COMPLETE": "complete_bash",
           "COMP_WORDS": words, "COMP_CWORD": str(cword)}
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool"], capture_output=True, text=True,
                          env=env, cwd=repo, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == expected

