"""Running a Megatron-LM worker script under torchrun for the peer tests: the cached Megatron-LM
sources (``fetch_megatron.py``) on the path, CPU only, ``CKPT_PEER_IMPL`` choosing whose
``dist_checkpointing`` Megatron-LM uses (``megatron_plugin``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def run_worker(root: Path, impl: str, worker: Path, nproc: int, *args: str,
               timeout: float = 900) -> str:
    """``worker ARGS`` on ``nproc`` gloo ranks with ``impl``'s dist_checkpointing (``ours`` or
    ``real``), in ``root``; returns the output, fails on rc != 0 or a timeout."""
    env = dict(os.environ, CKPT_PEER_IMPL=impl, CKPT_PEER_ROOT=str(root), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), str(root)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(worker), *args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{impl} {args} timed out after {timeout}s:\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"{impl} {args} failed ({proc.returncode}):\n{out[-6000:]}"
    return out
