"""One process, a 1-rank gloo group: end the script while gloo's workers still hold tensors.

    python late_release_worker.py {ckpt,mcore,none} PG_FILE

The script's last act queues a few collectives and returns without waiting; their tensors
were made in Python and Python has dropped them, so each worker's release of a finished work
needs the GIL. A long GIL switch interval keeps the workers waiting for it until the main
thread is done. Without a teardown the interpreter starts to finalize under them and the
process dies in "terminate called without an active exception" (SIGABRT) — what a ``save`` or
``load`` whose last collective's release comes late does, made likely instead of rare.
``ckpt`` imports ``ckpt_tool.dist_checkpointing`` first (which registers its exit handler),
``mcore`` the real ``megatron.core.dist_checkpointing``; ``none`` is the control.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def last_collectives() -> None:
    outs = [torch.empty(4) for _ in range(20)]
    dist.all_gather([outs[0]], torch.ones(4))
    for out in outs:
        dist.all_gather([out], torch.ones(4), async_op=True)


def main() -> None:
    mode, pg_file = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=0, world_size=1)
    if mode == "ckpt":
        import ckpt_tool.dist_checkpointing  # noqa: F401
    elif mode == "mcore":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from dist_worker import import_lib

        import_lib("mcore")
    print("ok", flush=True)
    sys.setswitchinterval(0.2)
    last_collectives()


if __name__ == "__main__":
    main()
