"""The root command: help lists every subcommand; commands not built yet say so and exit 2."""

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


BUILT = ["inspect", "validate", "diff", "convert", "reshard"]
PENDING = [c for c in COMMANDS if c not in BUILT]


def test_pending_list_matches_registration():
    from ckpt_tool.cli._pending import _PENDING

    assert set(PENDING) <= set(_PENDING)
    assert not set(BUILT) & set(PENDING)


@pytest.mark.parametrize("name", PENDING)
def test_pending_commands_say_so_and_exit_2(name):
    result = runner.invoke(app, [name, "some/path", "--tp", "2"])
    assert result.exit_code == 2
    assert "not built yet" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help(name):
    result = runner.invoke(app, [name, "--help"])
    assert result.exit_code == 0
    assert result.output.strip()


@pytest.mark.parametrize("name", BUILT)
def test_built_commands_are_not_placeholders(name):
    result = runner.invoke(app, [name, "--help"])
    assert "not built yet" not in result.output
