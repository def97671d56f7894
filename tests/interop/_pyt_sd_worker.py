"""PyT state dicts of the REAL Megatron-Core, in one process (single gloo rank, CPU).

    python _pyt_sd_worker.py RESULT SAVE_DIR LOAD_DIR

Converts :func:`request` with Megatron-Core's ``mcore_to_pyt_state_dict``, saves it into
SAVE_DIR with its ``MCoreSavePlanner``, loads LOAD_DIR with its ``MCoreLoadPlanner`` and writes
RESULT (JSON): the converted value types per key, and per key whether the load gave
:func:`expected` values (objects: the loaded value). The test imports the layout from here.
"""

from __future__ import annotations

import json
import os
import sys

import torch

FULL = torch.arange(24, dtype=torch.float32).reshape(4, 6)
STACKED = torch.arange(48, dtype=torch.bfloat16).reshape(2, 4, 6)
OBJECT = {"step": 7, "name": "x"}


def request(sharded_tensor, sharded_object, fill=None) -> dict:
    """``{key: [pieces]}``: two row pieces of "w", a whole "v", four pieces of a tensor
    stacked on a prepended axis, an object; ``fill`` makes an empty load request."""
    def piece(t):
        return t.clone() if fill is None else torch.full_like(t, fill)
    return {
        "w": [sharded_tensor.from_rank_offsets("w", piece(FULL[2 * i:2 * i + 2]), (0, i, 2))
              for i in range(2)],
        "v": [sharded_tensor.from_rank_offsets("v", piece(FULL[0]))],
        "s": [sharded_tensor.from_rank_offsets(
            "s", piece(STACKED[layer, 2 * tp:2 * tp + 2]), (0, layer, 2), (1, tp, 2),
            prepend_axis_num=1) for layer in range(2) for tp in range(2)],
        "o/shard_0_1": [sharded_object("o", None if fill is not None else OBJECT, (1,), (0,))],
    }


def expected(key: str, index: int) -> torch.Tensor:
    if key == "w":
        return FULL[2 * index:2 * index + 2]
    if key == "v":
        return FULL[0]
    return STACKED[index // 2, 2 * (index % 2):2 * (index % 2) + 2]


def main(result: str, save_dir: str, load_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.cuda.current_device = lambda: "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import torch as mst

    pyt = mst.mcore_to_pyt_state_dict(request(ShardedTensor, ShardedObject))
    out = {"types": {k: type(v).__name__ for k, v in pyt.items()}, "loaded": {}}
    dcp.save(pyt, checkpoint_id=save_dir, planner=mst.MCoreSavePlanner(flatten_state_dict=False))

    req = request(ShardedTensor, ShardedObject, fill=-1)
    pyt = mst.mcore_to_pyt_state_dict(req, is_loading=True)
    checked = [t for k in ("w", "v", "s") for t in req[k]]
    dcp.load(pyt, storage_reader=mst.CachedMetadataFileSystemReader(load_dir),
             planner=mst.MCoreLoadPlanner(shapes_validation_sharded_tensors=checked))
    for key, value in pyt.items():
        values = mst._unwrap_pyt_sharded_tensor(value)
        if key.startswith("o/"):
            out["loaded"][key] = values
        else:
            out["loaded"][key] = all(torch.equal(v, expected(key, i)) for i, v in enumerate(values))
    with open(result, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
