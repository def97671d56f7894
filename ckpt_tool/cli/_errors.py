"""The one error map at the CLI boundary: exception -> one line on stderr + exit code."""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import traceback
from typing import Any, Callable, Iterator, TypeVar

import typer
from typer.core import TyperGroup

from ckpt_tool.cli._output import error
from ckpt_tool.cli._startup import resume_gc
from ckpt_tool.errors import CkptError

__all__ = ["handle_errors", "state", "describe", "CkptGroup", "usage_line"]

F = TypeVar("F", bound=Callable[..., object])


class _State:
    debug: bool = False
    verdict: int = 0  # the exit code a command decided on before it renders
    interrupted: int = 0  # the stop signal that arrived (C++ code may turn it into another error)


state = _State()


def describe(exc: BaseException) -> tuple[str, int]:
    """The one line (without the ``ckpt: error:`` prefix) and the exit code for ``exc``, as the
    command boundary will report it."""
    if state.interrupted:
        from ckpt_tool._program import stop_line

        return stop_line(state.interrupted)
    return _exit_for(exc)


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _exit_for(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, CkptError):
        return exc.one_line(), exc.exit_code
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename}: no such file or directory (check the path)", 2
    if isinstance(exc, PermissionError):
        return f"{exc.filename}: permission denied (check the file permissions)", 2
    if isinstance(exc, IsADirectoryError | NotADirectoryError):
        return f"{exc.filename}: {exc.strerror}", 2
    if isinstance(exc, OSError):
        return f"{getattr(exc, 'filename', '') or ''}: {exc.strerror or exc} ".strip(), 2
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(exc, RuntimeError) and "gloo" in str(exc) and any(
            why in str(exc) for why in _PEER_GONE):
        why = next(w for w in _PEER_GONE if w in str(exc))
        return (f"another rank of the job ended while this one waited for it (gloo: {why}; "
                "see that rank's error)"), 2
    if isinstance(exc, MemoryError) or isinstance(exc, RuntimeError) \
            and "can't allocate memory" in str(exc):
        return ("out of memory (a size in the checkpoint's metadata may be absurd: 'ckpt "
                "validate' checks them)"), 2
    return f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", 2


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _watch_interrupts() -> None:
    """Ctrl-C (SIGINT) and SIGTERM raise KeyboardInterrupt, which unwinds the command (its
    staging directory removed, its output's lock released), and are remembered: raised inside
    a callback of torch's C++ writer the interrupt comes back as a RuntimeError ("enforce fail
    at inline_container.cc"), which must still read "interrupted" (exit 130) or "terminated"
    (143)."""
    import signal

    from ckpt_tool._program import (interrupt_deferred, output_committed, renaming,
                                    reset_interrupts, run_cleanups_and_end, stop_signals,
                                    under_launcher)
    from ckpt_tool._program import is_program as _is_program

    state.interrupted = 0
    reset_interrupts()
    if not _is_program():
        return

    def on_stop(signum: int, frame: object) -> None:
        if output_committed():  # the work is done: what is left is reporting it
            return
        state.interrupted = state.interrupted or signum
        if signum != signal.SIGINT and under_launcher() and not renaming():
            run_cleanups_and_end(signum)  # a torchrun rank: no unwinding through collectives
        if not interrupt_deferred():  # else raised where C code is no longer calling us
            raise KeyboardInterrupt

    for num in stop_signals():
        try:
            signal.signal(num, on_stop)
        except ValueError:  # not the main thread: Python's default handling stays
            pass


def _record_interrupts() -> None:
    """The command is over (it wrote or cleaned up): a late stop signal is ignored, so it
    cannot break off the exit (while the interpreter shuts down Python's own handler is gone,
    and the process would die by SIGINT instead of exiting with the command's code)."""
    import signal

    from ckpt_tool._program import is_program as _is_program
    from ckpt_tool._program import stop_signals

    if not _is_program():  # ckpt_tool.cli used as a library (tests): leave the host alone
        return
    for num in stop_signals():
        try:
            signal.signal(num, signal.SIG_IGN)
        except ValueError:
            pass


def handle_errors(fn: F) -> F:
    """Wrap a command body: CkptError and OS errors become one stderr line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        resume_gc()
        state.verdict = 0
        _watch_interrupts()
        try:
            result = fn(*args, **kwargs)
            _record_interrupts()
            return result
        except (typer.Exit, typer.Abort):
            _record_interrupts()
            raise
        except (BrokenPipeError, SystemExit) as exc:
            # The reader of our stdout went away (``ckpt diff ... | head``): not an error, and
            # the verdict the command reached stands.
            if isinstance(exc, SystemExit) and exc.code not in (None, 0, 1):
                raise
            _record_interrupts()
            _silence_stdout()
            raise typer.Exit(state.verdict) from None
        except BaseException as exc:  # noqa: BLE001 - this is the one boundary
            _record_interrupts()
            if state.debug:
                traceback.print_exc(file=sys.stderr)
            line, code = describe(exc)
            from ckpt_tool._program import end_by_signal, under_launcher

            if state.interrupted and state.interrupted != signal.SIGINT and under_launcher():
                end_by_signal(state.interrupted)  # cleaned up; torchrun reports how it ended
            from ckpt_tool._torchrun import record_error

            if record_error(line):  # under torchrun: rank 0 alone prints
                error(line)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]


# -- usage errors (raised by the command-line parser, before any command body runs) -------

def usage_line(exc: typer.TyperException) -> str:
    """A parser's usage error as one line: ``no such option: --frob (try 'ckpt convert
    --help')``."""
    possibilities = _close(getattr(exc, "option_name", ""), getattr(exc, "possibilities", ()))
    if hasattr(exc, "possibilities"):  # no such option (perhaps a near miss: ``--dry_run``)
        text = exc.message + (f"; did you mean {' or '.join(possibilities)}?"
                              if possibilities else "")
    else:
        text = exc.format_message()
    text = " ".join(text.split()).rstrip(".")
    if text[:1].isupper() and text[1:2].islower():
        text = text[0].lower() + text[1:]
    ctx: Any = getattr(exc, "ctx", None)
    if ctx is not None:
        text += f" (try '{ctx.command_path} --help')"
    return text


def _close(name: str, possibilities: Any) -> list[str]:
    """The parser's suggestions that are near misses of ``name`` (its own are loose: ``--to``
    for ``--frob``)."""
    import difflib

    return sorted(p for p in possibilities or ()
                  if difflib.SequenceMatcher(None, name, p).ratio() >= 0.75)


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except typer.TyperException as exc:
        code = getattr(exc, "exit_code", 2)
        if type(exc).__name__ == "NoArgsIsHelpError":  # ``ckpt`` alone: the help, on stderr
            sys.stderr.write(exc.format_message().rstrip("\n") + "\n")
        else:
            error(usage_line(exc))
        raise typer.Exit(code) from None


class CkptGroup(TyperGroup):
    """The root command. A usage error (unknown option or command, a bad or missing value) is
    one line on stderr and exit 2, like every other error, instead of the parser's usage block;
    ``--help`` shows the usage."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None,
                     **extra: Any) -> Any:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        nproc = ctx.params.get("nproc") or 1
        if nproc > 1 and not _one_process(self, ctx, nproc):
            return _launch(ctx, nproc)  # ``ckpt --nproc N COMMAND …``: on N ranks
        with _one_line_usage_errors():  # the subcommand's own arguments are parsed in here
            return super().invoke(ctx)


def _rest(ctx: Any) -> list[str]:
    """The command line after the root's options (the command and its arguments)."""
    return [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])),
            *ctx.args]


def _one_process(group: Any, ctx: Any, nproc: int) -> bool:
    """True (after a note) when the command is too small for ``--nproc`` to gain, or its
    command line is wrong (one process then reports that as one line, at once)."""
    from ckpt_tool.cli._launch import one_process_reason
    from ckpt_tool.parallel import under_torchrun

    rest = _rest(ctx)
    if not rest or under_torchrun():
        return False  # _launch says what is wrong
    try:
        name, cmd, args = group.resolve_command(ctx, list(rest))
        params = cmd.make_context(name, args, parent=ctx).params
    except typer.TyperException:  # a usage error
        return True
    reason = one_process_reason(name, params, nproc)
    if reason and not params.get("quiet"):
        from ckpt_tool.cli._output import fold, terminal_width

        width = terminal_width(sys.stderr)
        text = f"ckpt: note: {reason}"
        print(text if width is None else fold(text, width), file=sys.stderr)
    return reason is not None


def _launch(ctx: Any, nproc: int) -> Any:
    from ckpt_tool.cli._launch import run_on_ranks
    from ckpt_tool.parallel import under_torchrun

    rest = _rest(ctx)
    if not rest:
        error("--nproc needs a command (try 'ckpt --help')")
        raise typer.Exit(2)
    if under_torchrun():
        error("--nproc under torchrun: leave one of them out")
        raise typer.Exit(2)
    code, line = run_on_ranks(nproc, (["--debug"] if state.debug else []) + rest)
    if line:
        error(line)
    raise typer.Exit(code)
