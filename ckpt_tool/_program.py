"""Whether this process is the ``ckpt`` program (the console script, ``python -m ckpt_tool``,
torchrun) rather than a host that imports ``ckpt_tool`` as a library, and what the program
does about Ctrl-C before its command starts. Imported first by the package itself, so the
window in which an interrupt meets Python's own handler is the interpreter's start alone."""

from __future__ import annotations

import os
import sys

__all__ = ["is_program", "exit_on_interrupt"]


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
