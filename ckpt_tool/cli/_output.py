"""The one output helper: data to stdout (JSON or Rich), messages and progress to stderr.

Rich is imported only when something is rendered with it (a table, a tree, a progress bar):
``--json`` output and one-line messages are plain text, so they start faster and print
brackets in paths and verdicts (``[keys only]``) literally instead of reading them as markup.
"""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["stdout", "stderr", "print_json", "print_text", "message", "human_bytes",
           "quiet_unless_main_rank", "hush"]

# Piped output is read by people too (``| less``): don't squeeze tables to 80 columns there.
_PIPE_WIDTH = 200
_quiet = [False]  # messages dropped (a torchrun rank other than 0)
_hushed = [False]  # --quiet: only messages that explain a failure


class _LazyConsole:
    """A ``rich.console.Console`` built on first use (attribute access forwards to it)."""

    def __init__(self, *, to_stderr: bool) -> None:
        self._to_stderr = to_stderr
        self._console: Any = None

    @property
    def console(self) -> Any:
        """The Rich console itself (created now if it does not exist yet)."""
        if self._console is None:
            from rich.console import Console

            if self._to_stderr:
                self._console = Console(stderr=True, soft_wrap=True, quiet=_quiet[0])
            else:
                self._console = Console(soft_wrap=True,
                                        width=None if sys.stdout.isatty() else _PIPE_WIDTH)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


stdout = _LazyConsole(to_stderr=False)
stderr = _LazyConsole(to_stderr=True)


def print_json(data: Any) -> None:
    """Machine output: one JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def print_text(text: str) -> None:
    """Plain text on stdout (no markup, no highlighting): on a terminal wrapped between words
    to its width, so that no name is cut by the terminal's own wrapping; elsewhere as it is."""
    stdout.print(text, highlight=False, markup=False, soft_wrap=not sys.stdout.isatty())


def message(text: str, *, failure: bool = False) -> None:
    """A message for people, on stderr, as plain text (no markup, no highlighting). With
    ``--quiet`` only a ``failure`` (the verdict line of a non-zero exit) is printed."""
    if not _quiet[0] and (failure or not _hushed[0]):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def hush(value: bool = True) -> None:
    """``--quiet``: from now on :func:`message` prints failures only (reset by the root
    command for every run)."""
    _hushed[0] = value


def quiet_unless_main_rank() -> None:
    """Under torchrun only rank 0 prints: other ranks' stdout goes to /dev/null and their
    messages are dropped; their errors go to torchrun's reply file (`_torchrun.record_error`)."""
    import os

    from ckpt_tool.parallel import under_torchrun

    if not under_torchrun() or os.environ.get("RANK", "0") == "0":
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    _quiet[0] = True
    if stderr._console is not None:
        stderr._console.quiet = True


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
