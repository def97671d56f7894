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

__all__ = ["is_program", "exit_on_interrupt", "interrupts_deferred", "interrupt_deferred"]


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


def interrupt_deferred() -> bool:
    """Called by a Ctrl-C handler: inside ``interrupts_deferred`` the interrupt is recorded
    for the block's end (True); outside it, the handler raises (False)."""
    if _Deferral.depth:
        _Deferral.pending = True
        return True
    return False
