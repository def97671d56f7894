"""Runs the REAL Megatron-Core in one subprocess (single gloo rank, CPU) for the format tests.

    python _mcore_worker.py RESULT SAVE_DIR [CKPT ...]

saves a small torch_dist checkpoint into SAVE_DIR, then torch.saves to RESULT MCore's view
(``load_tensors_metadata`` dtypes/shapes and ``load_plain_tensors``) of SAVE_DIR and each CKPT:
``{path: {"meta": ..., "plain": ...}}`` or ``{path: {"error": "..."}}``.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
# MCore loads common.pt with torch.load's weights_only default, which refuses the numpy
# scalars real Megatron-LM args hold; the fixtures are ours, so load them fully here.
_torch_load = torch.load
torch.load = lambda *a, **k: _torch_load(*a, **{**k, "weights_only": False})


def _init() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 2000))
    dist.init_process_group("gloo", rank=0, world_size=1)


def save(out: str) -> None:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0
    w = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    g = torch.arange(4 * 6, dtype=torch.float32).reshape(2, 3, 4) / 7
    layers = torch.arange(4 * 3 * 2, dtype=torch.bfloat16).reshape(4, 3, 2)
    sd = {
        # dim 0 split into two chunks and a 2x2 grid: exercises chunk assembly and slicing.
        "w": [ShardedTensor.from_rank_offsets("decoder.w", w[2 * i:2 * i + 2].clone(), (0, i, 2))
              for i in range(2)],
        "g": [ShardedTensor.from_rank_offsets(
            "decoder.grid", g[:, 1 * j:1 * j + 1, 2 * k:2 * k + 2].clone(), (1, j, 3), (2, k, 2))
            for j in range(3) for k in range(2)],
        "b": ShardedTensor.from_rank_offsets("decoder.b", torch.ones(5, dtype=torch.bfloat16)),
        "layers": [ShardedTensor.from_rank_offsets(
            "decoder.layers.mlp.linear_fc1.weight", layers[i].clone(), (0, i, 4),
            prepend_axis_num=1) for i in range(4)],
        "rng": [ShardedObject("rng_state", {"seed": j, "t": torch.arange(3)}, (1, 2), (0, j))
                for j in range(2)],
        "args": argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                   num_layers=4, hidden_size=6, world_size=2),
        "iteration": 10,
        "checkpoint_version": 3.0,
    }
    dc.save(sd, out, content_metadata={"distrib_optim_sharding_type": "fully_reshardable"})


def describe(ckpt: str) -> dict:
    from megatron.core import dist_checkpointing as dc

    meta = dc.load_tensors_metadata(ckpt)
    view = {k: (str(v.dtype).removeprefix("torch."), tuple(v.global_shape))
            for k, v in meta.items()}
    plain = dc.load_plain_tensors(ckpt)
    return {"meta": view, "plain": {k: v for k, v in plain.items() if k in view}}


if __name__ == "__main__":
    _init()
    try:
        result_path, save_dir, *others = sys.argv[1:]
        save(save_dir)
        results = {}
        for ckpt in [save_dir, *others]:
            try:
                results[ckpt] = describe(ckpt)
            except Exception as exc:  # reported to the test, which decides
                results[ckpt] = {"error": f"{type(exc).__name__}: {exc}"}
        torch.save(results, result_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(0)
