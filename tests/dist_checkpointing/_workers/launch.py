"""Run a worker script under ``torchrun`` (gloo, CPU only) from a test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parent
REPO = WORKERS.parents[2]


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> str:
    """Run ``_workers/<script>`` on ``nproc`` ranks; returns the output, fails on rc != 0.

    ``--standalone`` makes torchrun pick a free rendezvous port, so tests never collide.
    """
    code, out, cmd = torchrun_outcome(script, nproc, *args, timeout=timeout)
    if code != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({code}):\n{out[-6000:]}")
    return out


def torchrun_outcome(script: str, nproc: int, *args: str, timeout: float = 300,
                     cwd: Path | None = None) -> tuple[int, str, list[str]]:
    """Like :func:`torchrun` but returns ``(exit code, stdout + stderr, command)``; only a
    timeout raises."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKERS / script), *map(str, args)]
    # Own session: on timeout the whole tree dies, including helpers holding our pipes.
    proc = subprocess.Popen(cmd, env=env, cwd=cwd or REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s:\n"
                             f"{(stdout + stderr)[-6000:]}") from None
    return proc.returncode, stdout + stderr, cmd
