"""torchrun worker run with a Python that has the REAL megatron-core 0.15.3 (zarr backend).

    torchrun --nproc-per-node N zarr_mcore015.py save <ckpt_dir>   # MCore 0.15 writes zarr
    torchrun --nproc-per-node N zarr_mcore015.py load <ckpt_dir>   # MCore 0.15 reads + checks

The layout is :func:`zarr_worker.sharded_state_dict` built with Megatron-Core's ShardedTensor,
plus a ShardedObject ``rng_state`` per rank and a common ``iteration``; ``load`` checks every
value bit-exactly. It must not import ckpt_tool (only torch and megatron-core are assumed).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

# CPU/gloo: the zarr save calls torch.cuda.synchronize() after each device->host copy
torch.cuda.synchronize = lambda *a, **k: None


def _layout():
    spec = importlib.util.spec_from_file_location(
        "zarr_worker", Path(__file__).with_name("zarr_worker.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(mode: str, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    layout = _layout()
    with_data = mode == "save"
    sd = layout.sharded_state_dict(rank, world, with_data=with_data, cls=ShardedTensor)
    sd["rng"] = ShardedObject("rng_state", {"rank": rank, "t": torch.arange(3) + rank},
                              (world,), (rank,), replica_id=0)
    sd["iteration"] = 10
    if with_data:
        dc.save(sd, ckpt_dir, sharded_strategy=("zarr", 1))
    else:
        loaded = dc.load(sd, ckpt_dir)
        assert loaded["iteration"] == 10, loaded["iteration"]
        assert loaded["rng"]["rank"] == rank and torch.equal(loaded["rng"]["t"], torch.arange(3) + rank)
        ref = layout.sharded_state_dict(rank, world, cls=ShardedTensor)
        for name, got in loaded.items():
            if name in ("rng", "iteration"):
                continue
            exp = ref[name]
            pairs = zip(got, exp) if isinstance(exp, list) else [(got, exp)]
            for g, e in pairs:
                assert g.dtype == e.data.dtype, (name, g.dtype, e.data.dtype)
                assert torch.equal(g.reshape(-1).view(torch.uint8),
                                   e.data.reshape(-1).view(torch.uint8)), name
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"OK mcore015 {mode} world={world}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown at interpreter exit (see ckpt_tool._torchrun)
