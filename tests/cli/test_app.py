"""The root command: help lists every subcommand, each with its own help."""

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
