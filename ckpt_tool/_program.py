"""Whether this process is the ``ckpt`` program (the console script, ``python -m ckpt_tool``,
torchrun) rather than a host that imports ``ckpt_tool`` as a library, and what the program
does about the signals that stop it (Ctrl-C's SIGINT, ``kill``'s SIGTERM) before its command
starts. Imported first by the package itself, so the window in which a signal meets Python's
own handling is the interpreter's start alone.

A stop signal gets one line and the shell's exit code for it: ``ckpt: error: interrupted``
(130) for SIGINT, ``ckpt: error: terminated`` (143) for SIGTERM. During a command both work
alike (``cli._errors``): a KeyboardInterrupt unwinds the command, which removes its staging
directory and releases its output's lock. Under torchrun a rank stopped by SIGTERM (the
launcher stops the other ranks that way when one fails, and passes its own SIGTERM on)
removes what it created at once (:func:`cleanup_on_stop`) and ends by that signal, silently,
as the launcher expects of it."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Callable, Iterator

__all__ = ["is_program", "exit_on_interrupt", "interrupts_deferred", "interrupt_deferred",
           "committing", "output_committed", "reset_interrupts", "STOP_SIGNALS", "stop_signals",
           "stop_line", "end_by_signal", "under_launcher", "cleanup_on_stop",
           "run_cleanups_and_end", "renaming", "stop_taken"]

#: The signals that stop the program, with the error line and the exit code each gets.
STOP_SIGNALS = {"SIGINT": ("interrupted", 130), "SIGTERM": ("terminated", 143)}


def stop_signals() -> list[int]:
    """The stop signals of this platform that the program may handle: those not ignored at
    start (``nohup``, a shell's background job: the user asked for them to be ignored)."""
    import signal

    out = []
    for name in STOP_SIGNALS:
        num = getattr(signal, name, None)
        if num is not None and signal.getsignal(num) is not signal.SIG_IGN:
            out.append(num)
    return out


def stop_line(signum: int) -> tuple[str, int]:
    """The error line (without ``ckpt: error:``) and the exit code for stop signal ``signum``."""
    import signal

    try:
        return STOP_SIGNALS.get(signal.Signals(signum).name, ("interrupted", 128 + signum))
    except ValueError:
        return "interrupted", 128 + signum


def end_by_signal(signum: int) -> None:
    """End the process by ``signum`` itself (its default action), as if no handler had been
    installed: what a launcher that sent it expects to see."""
    import signal

    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # (not reached)


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
    """While the program starts (imports: nothing written yet), a stop signal ends it at once
    with the one line and the exit code it always gets (SIGINT: 130, SIGTERM: 143); the
    command body installs its own handler (``_errors.handle_errors``)."""
    if not is_program():
        return
    import signal

    def on_stop(signum: int, frame: object) -> None:
        line, code = stop_line(signum)
        if signum != signal.SIGINT and under_launcher():
            end_by_signal(signum)
        os.write(2, f"ckpt: error: {line}\n".encode())
        os._exit(code)

    for num in stop_signals():
        try:
            signal.signal(num, on_stop)
        except ValueError:
            pass


def under_launcher() -> bool:
    """A rank of a torchrun job (its launcher reports how each rank ended)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ and \
        int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


class _Deferral:
    depth = 0  # open interrupts_deferred blocks (main thread)
    renaming = 0  # open committing blocks (main thread)
    pending = False  # Ctrl-C came inside one
    taken = False  # a stop signal reached the command's handler
    committed = False  # an output is in place: the command's work is done


_cleanups: dict[int, Callable[[], None]] = {}  # what a stopped rank removes: see cleanup_on_stop


@contextlib.contextmanager
def cleanup_on_stop(fn: Callable[[], None]) -> Iterator[None]:
    """While the block runs, a rank of a torchrun job that a stop signal ends calls ``fn``
    (removing a staging directory, a lock file) before it ends by the signal.

    A rank does not unwind on SIGTERM as a single process does: unwinding would meet the
    collectives of the code it leaves (the ranks agreeing on the outcome of a write), which
    ranks stopped at different moments, or a peer already gone, never complete. It removes
    what it created, at once, and ends (:func:`run_cleanups_and_end`)."""
    key = id(fn)
    _cleanups[key] = fn
    try:
        yield
    finally:
        _cleanups.pop(key, None)


def run_cleanups_and_end(signum: int) -> None:
    """Run the registered cleanups (newest first; a failing one does not stop the others),
    then end the process by ``signum`` (:func:`end_by_signal`)."""
    for key in reversed(list(_cleanups)):
        fn = _cleanups.pop(key, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
    end_by_signal(signum)


def renaming() -> bool:
    """Inside a ``committing`` block: an output is being put in place."""
    return _Deferral.renaming > 0


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
    _Deferral.renaming += 1
    try:
        yield
    except BaseException:
        _Deferral.depth -= 1
        _Deferral.renaming -= 1
        _Deferral.pending = _Deferral.pending and _Deferral.depth > 0
        raise
    _Deferral.depth -= 1
    _Deferral.renaming -= 1
    _Deferral.committed = True
    if _Deferral.depth == 0:
        _Deferral.pending = False


def reset_interrupts() -> None:
    """A command starts: nothing deferred, nothing committed yet."""
    _Deferral.pending = False
    _Deferral.committed = False
    _Deferral.taken = False


def stop_taken() -> bool:
    """The command's handler took a stop signal (it raised, or deferred it to a block's end)."""
    return _Deferral.taken


def output_committed() -> bool:
    """A ``committing`` block of this command succeeded: its output is in place."""
    return _Deferral.committed


def interrupt_deferred() -> bool:
    """Called by a Ctrl-C handler: inside ``interrupts_deferred`` or ``committing`` the
    interrupt is recorded for the block's end (True); outside them, the handler raises
    (False)."""
    _Deferral.taken = True
    if _Deferral.depth:
        _Deferral.pending = True
        return True
    return False
