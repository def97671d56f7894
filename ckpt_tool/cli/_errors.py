"""The one error map at the CLI boundary: exception -> one line on stderr + exit code."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable, TypeVar

import typer

from ckpt_tool.cli._startup import resume_gc
from ckpt_tool.errors import CkptError

__all__ = ["handle_errors", "state", "describe"]

F = TypeVar("F", bound=Callable[..., object])


class _State:
    debug: bool = False
    verdict: int = 0  # the exit code a command decided on before it renders
    interrupted: bool = False  # SIGINT arrived (C++ code may turn it into another error)


state = _State()


def describe(exc: BaseException) -> tuple[str, int]:
    """The one line (without the ``ckpt: error:`` prefix) and the exit code for ``exc``, as the
    command boundary will report it."""
    return ("interrupted", 130) if state.interrupted else _exit_for(exc)


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
    return f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", 2


def _silence_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _watch_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: raised inside a callback
    of torch's C++ writer it comes back as a RuntimeError ("enforce fail at
    inline_container.cc"), which must still read "interrupted" (exit 130)."""
    import signal

    from ckpt_tool._program import is_program as _is_program

    state.interrupted = False
    if not _is_program():
        return

    def on_sigint(signum: int, frame: object) -> None:
        state.interrupted = True
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: Python's default handler stays
        pass


def _record_interrupts() -> None:
    """The command is over (it wrote or cleaned up): a late Ctrl-C is ignored, so it cannot
    break off the exit (while the interpreter shuts down Python's own handler is gone, and the
    process would die by SIGINT instead of exiting with the command's code)."""
    import signal

    from ckpt_tool._program import is_program as _is_program

    if not _is_program():  # ckpt_tool.cli used as a library (tests): leave the host alone
        return
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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
            import os

            rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else "0"
            prog = "ckpt" if rank == "0" else f"ckpt[rank {rank}]"
            print(f"{prog}: error: {line}", file=sys.stderr)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]
