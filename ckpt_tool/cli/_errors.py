"""The one error map at the CLI boundary: exception -> one line on stderr + exit code."""

from __future__ import annotations

import functools
import sys
import traceback
from typing import Callable, TypeVar

import typer

from ckpt_tool.cli._startup import resume_gc
from ckpt_tool.errors import CkptError

__all__ = ["handle_errors", "state"]

F = TypeVar("F", bound=Callable[..., object])


class _State:
    debug: bool = False
    verdict: int = 0  # the exit code a command decided on before it renders


state = _State()


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


def handle_errors(fn: F) -> F:
    """Wrap a command body: CkptError and OS errors become one stderr line and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        resume_gc()
        state.verdict = 0
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except (BrokenPipeError, SystemExit) as exc:
            # The reader of our stdout went away (``ckpt diff ... | head``): not an error, and
            # the verdict the command reached stands.
            if isinstance(exc, SystemExit) and exc.code not in (None, 0, 1):
                raise
            _silence_stdout()
            raise typer.Exit(state.verdict) from None
        except BaseException as exc:  # noqa: BLE001 - this is the one boundary
            if state.debug:
                traceback.print_exc(file=sys.stderr)
            line, code = _exit_for(exc)
            import os

            rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else "0"
            prog = "ckpt" if rank == "0" else f"ckpt[rank {rank}]"
            print(f"{prog}: error: {line}", file=sys.stderr)
            raise typer.Exit(code) from None

    return wrapper  # type: ignore[return-value]
