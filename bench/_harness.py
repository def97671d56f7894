"""Run commands as child processes and measure wall time and the child's own peak RSS."""

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


def run(label: str, argv: list[str], *, repeat: int = 1, env: dict | None = None) -> Run:
    """Best-of-``repeat`` wall time; peak RSS (from ``wait4``) of the best run."""
    best: Run | None = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err = proc.stderr.read().decode(errors="replace")[-2000:]
            sys.exit(f"{label} failed ({code}): {shlex.join(argv)}\n{err}")
        proc.stderr.close()
        r = Run(label, dt, usage.ru_maxrss / 1024, code)
        if best is None or r.seconds < best.seconds:
            best = r
    assert best is not None
    return best


def drop_page_cache_hint() -> None:
    """Warm runs are what we compare (both sides read the same cached files)."""


def report(title: str, runs: list[Run], baseline: str) -> None:
    base = next(r for r in runs if r.label == baseline)
    print(f"\n{title}")
    print(f"{'what':44s} {'seconds':>9s} {'peak RSS MB':>12s} {'speed vs ' + baseline:>22s}")
    for r in runs:
        ratio = base.seconds / r.seconds if r.seconds else float("inf")
        print(f"{r.label:44s} {r.seconds:9.3f} {r.peak_rss_mb:12.1f} {ratio:21.2f}x")


def python_cmd(code: str) -> list[str]:
    return [sys.executable, "-c", code]
