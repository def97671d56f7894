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


def run_on_terminal(argv: list[str], *, columns: int, cwd=None, stderr_too: bool = True,
                    timeout: float = 300) -> tuple[int, str]:
    """``python -m ckpt_tool ARGV`` with stdout (and stderr unless ``stderr_too`` is False:
    then a pipe, dropped) on a pseudo-terminal ``columns`` wide: the exit code and the text the
    terminal received (``\\r\\n`` read as ``\\n``). The terminal is a real one, so Rich
    measures its width as it would in a shell; COLUMNS is left out of the environment."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {"PYTHONPATH": str(repo), **os.environ, "TERM": "xterm-256color"}
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *argv], cwd=cwd or repo,
                            env=env, stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave if stderr_too else subprocess.DEVNULL)
    os.close(slave)
    text = drain_terminal(master).decode(errors="replace")
    proc.wait(timeout=timeout)
    return proc.returncode, text.replace("\r\n", "\n")
