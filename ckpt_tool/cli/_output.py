"""The one output helper: data to stdout (JSON or Rich), messages and progress to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

__all__ = ["stdout", "stderr", "print_json", "message", "human_bytes", "quiet_unless_main_rank"]

# Piped output is read by people too (``| less``): don't squeeze tables to 80 columns there.
_PIPE_WIDTH = 200
stdout = Console(soft_wrap=True, width=None if sys.stdout.isatty() else _PIPE_WIDTH)
stderr = Console(stderr=True, soft_wrap=True)


def print_json(data: Any) -> None:
    """Machine output: one JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def message(text: str) -> None:
    """A message for people, on stderr."""
    stderr.print(text, highlight=False)


def quiet_unless_main_rank() -> None:
    """Under torchrun only rank 0 prints: other ranks' stdout goes to /dev/null and their
    messages are dropped (their errors still reach stderr, tagged with the rank)."""
    import os

    from ckpt_tool.parallel import under_torchrun

    if not under_torchrun() or os.environ.get("RANK", "0") == "0":
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    stderr.quiet = True


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
