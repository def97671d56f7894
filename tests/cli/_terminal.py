"""Reading what a child process wrote to a pseudo-terminal (the progress-bar tests)."""

from __future__ import annotations

import os


def drain_terminal(master: int) -> bytes:
    """Everything written to the terminal whose master side is ``master``, until the child
    closes it; ``master`` is closed on return."""
    got = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        got.append(data)
    os.close(master)
    return b"".join(got)
