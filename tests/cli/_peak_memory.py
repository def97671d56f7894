"""Test helper: the peak memory of a ``python -m ckpt_tool`` command, sampled while it runs.

``RssAnon`` (``/proc/PID/status``) is the anonymous memory a process holds: what a convert must
keep bounded. ``RssFile`` (mapped file pages: the checkpoint's files, shared libraries) is
reported beside it, not bounded by the tests: those pages are clean and the kernel reclaims
them. Both are summed over the command's process tree (a command may run parts in children),
every 2 ms; the peak is the highest sample.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Peak", "ckpt_peak"]

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Peak:
    """Peaks of a command, in bytes: ``anon`` (``RssAnon``) and ``file`` (``RssFile``)."""

    anon: int
    file: int


def _status_kib(pid: int) -> tuple[int, int]:
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1])
    except OSError:
        pass
    return anon, file


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def _tree_kib(pid: int) -> tuple[int, int]:
    anon, file = _status_kib(pid)
    for kid in _children(pid):
        a, f = _tree_kib(kid)
        anon, file = anon + a, file + f
    return anon, file


def ckpt_peak(*args: object) -> Peak:
    """Run ``python -m ckpt_tool ARGS`` (this checkout) in a child; assert it exits 0 and
    return its sampled peaks."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *map(str, args)],
                                cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
        anon = file = 0
        while proc.poll() is None:
            a, f = _tree_kib(proc.pid)
            anon, file = max(anon, a), max(file, f)
            time.sleep(0.002)
        err.seek(0)
        assert proc.returncode == 0, err.read().decode(errors="replace")[-3000:]
    return Peak(anon << 10, file << 10)
