"""torchrun worker: a typical user script that saves and reloads resharded, then just exits.

    torchrun --nproc-per-node 2 exit_worker.py --lib {ours,mcore,none} --dir CKPT

It saves a 4x4 tensor split along dim 0 with ``dist_checkpointing.save``, loads it split along
dim 1 (a resharded load), checks the values, prints ``ok RANK`` and leaves like most training
scripts do: without ``destroy_process_group``. Issue 15 item 5: such a run sometimes ended in
"terminate called without an active exception" (SIGABRT) after printing ok. ``--lib none`` does
the same collectives' kind of work without any checkpoint library (the control).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", choices=("ours", "mcore", "none"), default="ours")
    p.add_argument("--dir", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    if a.lib == "none":
        objs: list = [None] * world
        dist.all_gather_object(objs, {"rank": rank})
        t = full[rank * 2:(rank + 1) * 2].clone()
        dist.all_reduce(t)
        dist.broadcast_object_list(objs, src=0)
        _say_ok(rank)
        return
    from dist_worker import import_lib

    lib, mapping = import_lib(a.lib)
    rows = full[rank * 2:(rank + 1) * 2].clone()
    lib.save({"w": mapping.ShardedTensor.from_rank_offsets("w", rows, (0, rank, world),
                                                           replica_id=0)}, a.dir)
    cols = torch.empty(4, 4 // world)
    out = lib.load({"w": mapping.ShardedTensor.from_rank_offsets("w", cols, (1, rank, world),
                                                                 replica_id=0)}, a.dir)
    want = full[:, rank * 2:(rank + 1) * 2]
    if not torch.equal(out["w"], want):
        raise SystemExit(f"rank {rank}: loaded {out['w'].tolist()}, expected {want.tolist()}")
    _say_ok(rank)


def _say_ok(rank: int) -> None:
    """``ok RANK`` in one write (torchrun runs ranks with ``python -u`` on one pipe: print's
    pieces from two ranks interleave)."""
    os.write(1, f"ok {rank}\n".encode())


if __name__ == "__main__":
    main()
