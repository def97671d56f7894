"""Whether this process is the ``ckpt`` program (the console script, ``python -m ckpt_tool``,
torchrun) rather than a host that imports ``ckpt_tool`` as a library, and what the program
does about Ctrl-C before its command starts. Imported first by the package itself, so the
window in which an interrupt meets Python's own handler is the interpreter's start alone."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

__all__ = ["is_program", "exit_on_interrupt", "interrupts_deferred", "interrupt_deferred",
           "committing", "output_committed", "reset_interrupts"]


def is_program() -> bool:
    """This process runs ``ckpt`` (the console script, ``python -m ckpt_tool``, torchrun)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "ckpt_tool.__main__":
        return True
    argv = list(getattr(sys, "orig_argv", ()))  # `python -m ckpt_tool` while runpy imports us
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "ckpt_tool":
        return True
    return os.path.basename(getattr(main, "__file__", None) or "") == "ckpt"


def exit_on_interrupt() -> None:
    """While the program starts (imports: nothing written yet), Ctrl-C ends it at once with
    the one line and exit 130 every interrupt gets; the command body installs its own
    handler (``_errors.handle_errors``)."""
    if not is_program():
        return
    import signal

    def on_sigint(signum: int, frame: object) -> None:
        os.write(2, b"ckpt: error: interrupted\n")
        os._exit(130)

    try:
        signal.signal(signal.SIGINT, on_sigint)
    except ValueError:
        pass


class _Deferral:
    depth = 0  # open interrupts_deferred blocks (main thread)
    pending = False  # Ctrl-C came inside one
    committed = False  # an output is in place: the command's work is done


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block takes effect when it ends (KeyboardInterrupt raised there).

    For Python code that C code calls back (a stream's ``write`` under torch's zip writer): an
    exception raised in such a callback cannot unwind through the C frames and aborts the
    process. Only the ckpt program's handler (``cli._errors``) defers; Python's default one,
    in a host that imports ckpt_tool as a library, is left as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run in the main thread only
        return
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
        if _Deferral.depth == 0 and _Deferral.pending:
            _Deferral.pending = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """The renames that put a finished output in place. Ctrl-C inside waits for their end;
    once they succeed the output is complete, and a later Ctrl-C is ignored for the rest of
    the command (what is left is reporting it): an interrupt never leaves a complete output
    behind a failure exit. If the block fails, a deferred interrupt is reported by the
    command's handler (the failure propagates)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _Deferral.depth += 1
    try:
        yield
    except BaseException:
        _Deferral.depth -= 1
        _Deferral.pending = _Deferral.pending and _Deferral.depth > 0
        raise
    _Deferral.depth -= 1
    _Deferral.committed = True
    if _Deferral.depth == 0:
        _Deferral.pending = False


def reset_interrupts() -> None:
    """A command starts: nothing deferred, nothing committed yet."""
    _Deferral.pending = False
    _Deferral.committed = False


def output_committed() -> bool:
    """A ``committing`` block of this command succeeded: its output is in place."""
    return _Deferral.committed


def interrupt_deferred() -> bool:
    """Called by a Ctrl-C handler: inside ``interrupts_deferred`` or ``committing`` the
    interrupt is recorded for the block's end (True); outside them, the handler raises
    (False)."""
    if _Deferral.depth:
        _Deferral.pending = True
        return True
    return False
