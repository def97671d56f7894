"""Root of the ``ckpt`` command: global options and command registration."""

import sys
from typing import Annotated, Optional

from ckpt_tool.cli._startup import pause_gc

pause_gc()  # before typer: see _startup

import typer  # noqa: E402

from ckpt_tool import __version__  # noqa: E402
from ckpt_tool.cli._errors import CkptGroup, state  # noqa: E402
from ckpt_tool.cli._output import hush, quiet_unless_main_rank  # noqa: E402

app = typer.Typer(
    name="ckpt",
    help="Inspect, validate, reshard, convert and diff large-model training checkpoints.",
    no_args_is_help=True,
    # --install-completion / --show-completion; the shell is detected only when one is used
    add_completion=True,
    pretty_exceptions_enable=False,
    # plain help: wrapped at the terminal's width (at most 80 columns), never truncated
    rich_markup_mode=None,
    cls=CkptGroup,
)


def _version(value: bool) -> None:
    if value:
        print(f"ckpt {__version__}")
        raise typer.Exit(0)


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
    nproc: Annotated[int, typer.Option(
        "--nproc", min=1, metavar="N",
        help="Run the command on N local ranks (torchrun's launcher, started by ckpt): the "
             "same output and exit code as one process.")] = 1,
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = None,
) -> None:
    """Inspect, validate, reshard, convert and diff large-model training checkpoints."""
    state.debug = debug  # a command's own --debug (after its name) may set it too
    hush(False)  # until a command's --quiet
    quiet_unless_main_rank()


def _register() -> None:
    from ckpt_tool.cli import convert as convert_cmd
    from ckpt_tool.cli import diff as diff_cmd
    from ckpt_tool.cli import inspect as inspect_cmd
    from ckpt_tool.cli import reshard as reshard_cmd
    from ckpt_tool.cli import validate as validate_cmd

    # short_help: the commands list shows whole sentences, never one cut off at 80 columns
    app.command("inspect", short_help="Show tensors, objects and common state (metadata "
                "only).")(inspect_cmd.inspect)
    app.command("validate", short_help="Check completeness and integrity (the CI "
                "job).")(validate_cmd.validate)
    app.command("reshard", short_help="Rewrite for another TP/PP/EP layout, ready to "
                "resume.")(reshard_cmd.reshard)
    app.command("convert", short_help="Rewrite in another format, "
                "streaming.")(convert_cmd.convert)
    app.command("diff", short_help="Compare two checkpoints of any formats.")(diff_cmd.diff)


_register()


def main() -> None:
    """Console-script entry point. Under torchrun, once a process group exists, the process
    leaves through ``exit_cleanly`` (gloo's threads can abort a normal interpreter exit)."""
    from ckpt_tool._torchrun import exit_cleanly, group_initialized

    from ckpt_tool.cli._startup import print_names_as_bytes

    print_names_as_bytes()
    code: object = 0
    try:
        app(prog_name="ckpt")  # also under ``python -m ckpt_tool`` and torchrun
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        from ckpt_tool.cli._output import error

        error("interrupted")
        code = 130
    if code in (None, 0, 1) and not state.interrupted:
        _join_ranks()
    # an interrupted command leaves through exit_cleanly too: while the interpreter shuts
    # down, a torch interrupted mid-import can end the process by SIGINT instead of 130
    if not group_initialized() and not state.interrupted and code != 130:
        raise SystemExit(code)
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    exit_cleanly(code)


def _join_ranks() -> None:
    """Under torchrun, a verdict (0 or 1) is every rank's: a command that never needed a
    process group (``diff --keys-only``) makes one now, so that ``exit_cleanly``'s barrier
    keeps every rank until rank 0 has printed (once a rank leaves, torchrun's agent stops
    the others at once)."""
    from ckpt_tool._torchrun import group_initialized
    from ckpt_tool.parallel import ranks, under_torchrun

    if under_torchrun() and not group_initialized():
        try:
            ranks()
        except Exception:  # noqa: BLE001 - no rendezvous: leave as before
            pass
