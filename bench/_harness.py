"""Run commands as child processes and measure wall time, the child's own peak RSS and its
peak anonymous memory (``RssAnon``, sampled: file-backed pages of mapped files are clean and
reclaimable, anonymous memory is what the process holds)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Run:
    label: str
    seconds: float
    peak_rss_mb: float
    returncode: int
    peak_anon_mb: float = 0.0


def _anon_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return kids


def _tree_anon_kib(pid: int) -> int:
    """``RssAnon`` of ``pid`` and all its descendants (a command may re-exec itself in a child,
    as ``wait4``'s peak RSS already counts)."""
    return _anon_kib(pid) + sum(_tree_anon_kib(c) for c in _children(pid))


def run(label: str, argv: list[str], *, repeat: int = 1, env: dict | None = None) -> Run:
    """Best-of-``repeat`` wall time; peak RSS (from ``wait4``) of the best run."""
    best: Run | None = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {})})
        anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _tree_anon_kib(proc.pid))
            time.sleep(0.002)
        dt = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err = proc.stderr.read().decode(errors="replace")[-2000:]
            sys.exit(f"{label} failed ({code}): {shlex.join(argv)}\n{err}")
        proc.stderr.close()
        r = Run(label, dt, usage.ru_maxrss / 1024, code, anon / 1024)
        if best is None or r.seconds < best.seconds:
            best = r
    assert best is not None
    return best


def drop_page_cache_hint() -> None:
    """Warm runs are what we compare (both sides read the same cached files)."""


def report(title: str, runs: list[Run], baseline: str) -> None:
    base = next(r for r in runs if r.label == baseline)
    print(f"\n{title}")
    print(f"{'what':44s} {'seconds':>9s} {'peak RSS MB':>12s} {'peak anon MB':>13s} "
          f"{'speed vs ' + baseline:>22s}")
    for r in runs:
        ratio = base.seconds / r.seconds if r.seconds else float("inf")
        print(f"{r.label:44s} {r.seconds:9.3f} {r.peak_rss_mb:12.1f} {r.peak_anon_mb:13.1f} "
              f"{ratio:21.2f}x")


def python_cmd(code: str) -> list[str]:
    return [sys.executable, "-c", code]
