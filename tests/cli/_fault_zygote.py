"""A process that imports ``ckpt`` and torch once, then forks one child per job, so that the
fault-injection test (``test_faults.py``) can kill many short runs without paying the imports
each time. One JSON request per line on stdin, one JSON reply per line on stdout:

* ``{"argv": [...], "log": PATH}`` -> ``{"pid": N}``: the child runs ``ckpt ARGV`` (stdout and
  stderr into ``PATH``) in a process group of its own (killing the group also kills the
  async save's writer process);
* ``{"save": DIR, "log": PATH}`` -> ``{"pid": N}``: the child saves ``state()`` into ``DIR`` with
  the library's async save (the background write, then finalize) and exits 0;
* ``{"wait": N}`` -> ``{"status": S}``: the child's exit code, or minus the signal that ended it;
* ``{"poll": N}`` -> ``{"status": S or null}``: the same without waiting (null: still running).

A job request may add ``"env": {...}`` (set in the child before it runs: the pause points of
``ckpt_tool._pause_points``) and ``"no_exchange": true``: the child's file system cannot
exchange two paths atomically (it stands for NFS, FUSE or an old kernel, where ``renameat2``
fails with EINVAL), so replacing an output parks the old one for a moment.
"""

from __future__ import annotations

import json
import os
import sys

import torch  # noqa: F401  (imported once, before the forks)
import torch.distributed.checkpoint  # noqa: F401

import ckpt_tool.dist_checkpointing as dc  # noqa: F401
from ckpt_tool.cli.app import main as ckpt_main
from ckpt_tool.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from ckpt_tool.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

# what the commands import lazily, imported here once (a child's imports die with it)
import ckpt_tool.cli.convert, ckpt_tool.cli.reshard, ckpt_tool.cli.validate  # noqa: E401,F401
import ckpt_tool.ops.convert, ckpt_tool.ops.reshard, ckpt_tool.ops.validate  # noqa: E401,F401
import ckpt_tool.formats.writer, ckpt_tool.formats.safetensors.writer  # noqa: E401,F401
import ckpt_tool.formats.dcp.writer, ckpt_tool.formats.legacy.writer  # noqa: E401,F401
import ckpt_tool.formats.mcore_dist.torch_dist_writer  # noqa: F401
import safetensors.torch  # noqa: F401
import rich.console  # noqa: F401


def state() -> dict:
    """A small sharded state dict (about 4 MB) with an object and common values."""
    g = torch.Generator().manual_seed(0)
    sd = {f"layer{i}.weight": ShardedTensor.from_rank_offsets(
        f"layer{i}.weight", torch.randn(256, 512, generator=g)) for i in range(8)}
    sd["rng"] = ShardedObject("rng", {"seed": 7}, (1,), (0,), replica_id=0)
    sd["iteration"] = 12
    return sd


def _save(ckpt_dir: str) -> int:
    queue = AsyncCallsQueue()
    request = dc.save(state(), ckpt_dir, async_sharded_save=True)
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    queue.close()
    return 0


def no_exchange() -> None:
    """``renameat2(RENAME_EXCHANGE)`` answers EINVAL in this process, as it does on a file
    system without it (NFS, FUSE): ``ops._output_staging.exchange`` then parks the old output."""
    import ctypes
    import errno

    import ckpt_tool.ops._output_staging as staging

    def einval(*args: object) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    staging._renameat2 = lambda: einval


def _child(job: dict) -> int:
    os.setpgid(0, 0)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(job.get("env", {}))
    if job.get("no_exchange"):
        no_exchange()
    if "save" in job:
        return _save(job["save"])
    sys.argv = ["ckpt", *job["argv"]]
    try:
        ckpt_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def serve() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        if "wait" in job or "poll" in job:
            pid, status = os.waitpid(job.get("wait") or job["poll"],
                                     0 if "wait" in job else os.WNOHANG)
            code = None if pid == 0 else -os.WTERMSIG(status) if os.WIFSIGNALED(status) \
                else os.WEXITSTATUS(status)
            reply = {"status": code}
        else:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(job)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            reply = {"pid": pid}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
