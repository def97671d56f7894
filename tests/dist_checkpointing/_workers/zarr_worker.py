"""torchrun worker for the zarr strategy tests (gloo, CPU).

    torchrun --nproc-per-node N zarr_worker.py save <ckpt_dir>
    torchrun --nproc-per-node N zarr_worker.py load <ckpt_dir>
    torchrun --nproc-per-node N zarr_worker.py save-bad <ckpt_dir>   # must fail on all ranks
    torchrun --nproc-per-node N zarr_worker.py api-save <ckpt_dir>   # dist_checkpointing.save
    torchrun --nproc-per-node N zarr_worker.py api-load <ckpt_dir>

``save`` writes the sharding of :func:`sharded_state_dict` for the current world size through
``ZarrSaveShardedStrategy``; ``load`` reads it back at the current world size (which may differ
from the saving one) and checks every tensor bit-exactly against :func:`global_tensors`.
The ``api-*`` modes do the same through the public ``save``/``load`` (with a ShardedObject).
"""

from __future__ import annotations

import os
import sys

import torch


def global_tensors(world: int = 4) -> dict:
    """The reference global tensors (identical on every rank and in the test process)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "rows.weight": torch.randn(8, 6, generator=g),
        "grid.bf16": torch.randn(4, 8, generator=g).bfloat16(),
        "ids": torch.randint(-(2**40), 2**40, (5, 3), generator=g, dtype=torch.int64),
        "stacked": torch.randn(4, 3, 4, generator=g).bfloat16(),
        "flat.exp_avg": torch.randn(8, 6, generator=g),
    }


def sharded_state_dict(rank: int, world: int, *, with_data: bool = True, cls=None) -> dict:
    """ShardedTensors of ``global_tensors`` as rank ``rank`` of ``world`` holds them.

    ``cls`` is the ShardedTensor class (ours by default; Megatron-Core's for interop runs).
    """
    if cls is None:
        from ckpt_tool.dist_checkpointing.mapping import ShardedTensor as cls
    ShardedTensor = cls

    ref = global_tensors()
    data = (lambda t: t.clone()) if with_data else torch.empty_like
    out = {}
    # split along dim 0 into `world` pieces
    rows = ref["rows.weight"].chunk(world, 0)[rank]
    out["rows"] = ShardedTensor.from_rank_offsets("rows.weight", data(rows), (0, rank, world))
    # a 2-D grid: 2 x (world // 2) fragments (1 x 1 on a single rank)
    f0 = 2 if world >= 2 else 1
    f1 = world // f0
    r0, r1 = divmod(rank, f1)
    piece = ref["grid.bf16"].chunk(f0, 0)[r0].chunk(f1, 1)[r1]
    out["grid"] = ShardedTensor.from_rank_offsets(
        "grid.bf16", data(piece), (0, r0, f0), (1, r1, f1)
    )
    # replicated on every rank: only rank 0 is the main replica
    out["ids"] = ShardedTensor.from_rank_offsets("ids", data(ref["ids"]), replica_id=rank)
    # stacked layers (prepend_axis_num=1): rank r holds layers r, r+world, ...
    out["stacked"] = [
        ShardedTensor.from_rank_offsets(
            "stacked", data(ref["stacked"][layer]), (0, layer, 4), prepend_axis_num=1
        )
        for layer in range(rank, 4, world)
    ]
    if world > 1 and world % 2 == 0:
        # flattened: pairs of ranks share one (8 // (world//2), 6) local piece, half each
        pieces = world // 2
        local = ref["flat.exp_avg"].chunk(pieces, 0)[rank // 2]
        half = local.numel() // 2
        rng = slice((rank % 2) * half, (rank % 2 + 1) * half)
        out["flat"] = ShardedTensor.from_rank_offsets_flat(
            "flat.exp_avg",
            data(local.flatten()[rng]),
            tuple(local.shape),
            (0, rank // 2, pieces),
            flattened_range=rng,
        )
    return out


def _check(loaded: dict, rank: int, world: int) -> None:
    ref = sharded_state_dict(rank, world)
    for name, got in loaded.items():
        expected = ref[name]
        pairs = zip(got, expected) if isinstance(expected, list) else [(got, expected)]
        for g, e in pairs:
            assert g.dtype == e.data.dtype, (name, g.dtype, e.data.dtype)
            assert torch.equal(g.view(-1).view(torch.uint8), e.data.reshape(-1).view(torch.uint8)), name


def main(mode: str, ckpt_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if mode == "save":
        from ckpt_tool.dist_checkpointing.strategies.zarr import ZarrSaveShardedStrategy

        ZarrSaveShardedStrategy("zarr", 1).save(sharded_state_dict(rank, world), ckpt_dir)
    elif mode == "load":
        from ckpt_tool.dist_checkpointing.strategies.zarr import ZarrLoadShardedStrategy

        request = sharded_state_dict(rank, world, with_data=False)
        _check(ZarrLoadShardedStrategy().load(request, ckpt_dir), rank, world)
    elif mode == "save-bad":
        # nobody holds the origin chunk of "orphan": only the ranks > 0 fail, all must raise
        from ckpt_tool.dist_checkpointing.mapping import ShardedTensor
        from ckpt_tool.dist_checkpointing.strategies.zarr import ZarrSaveShardedStrategy

        sd = {"ok": ShardedTensor.from_rank_offsets("ok", torch.ones(2), (0, rank, world))}
        if rank > 0:
            sd["orphan"] = ShardedTensor.from_rank_offsets("orphan", torch.ones(2), (0, rank, world))
        try:
            ZarrSaveShardedStrategy("zarr", 1).save(sd, ckpt_dir)
        except Exception as e:  # noqa: BLE001
            print(f"rank {rank} raised: {e}", flush=True)
            raise SystemExit(3)
        raise SystemExit(0)
    elif mode in ("api-save", "api-load"):
        from ckpt_tool import dist_checkpointing as dc
        from ckpt_tool.dist_checkpointing.mapping import ShardedObject

        with_data = mode == "api-save"
        sd = sharded_state_dict(rank, world, with_data=with_data)
        obj = {"rank": rank, "t": torch.arange(3) + rank} if with_data else None
        sd["rng"] = ShardedObject("rng_state", obj, (world,), (rank,), replica_id=0)
        sd["iteration"] = 10
        if with_data:
            dc.save(sd, ckpt_dir, sharded_strategy=("zarr", 1))
        else:
            loaded = dc.load(sd, ckpt_dir)
            assert loaded["rng"]["rank"] == rank, loaded["rng"]
            assert torch.equal(loaded["rng"]["t"], torch.arange(3) + rank)
            assert loaded["iteration"] == 10
            _check({k: v for k, v in loaded.items() if k not in ("rng", "iteration")}, rank, world)
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if rank == 0:
        print(f"OK {mode} world={world}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(0)
