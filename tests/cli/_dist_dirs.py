"""Test helper: GPT-shaped Megatron-Core ``torch_dist`` checkpoints of any size, written by the
real ``torch.distributed.checkpoint.save`` on one gloo rank, as Megatron-Core 0.16's torch_dist
backend stores them (without importing megatron.core, which takes seconds).

Same names, shapes and chunking as ``bench/make_synthetic.py`` at TP1: each stacked
``decoder.layers.*`` tensor a torch ``ShardedTensor`` with one local shard per layer (one DCP
chunk each), embedding and output layer whole (the largest tensors: ``vocab x hidden``
fp32), the common state (``args``, ``iteration``, ``checkpoint_version``) in ``common.pt``
and ``metadata.json``; two ``.distcp`` files (Megatron-Core's ``thread_count=2``). No
ShardedObjects (DCP's stock planner does not store them as Megatron-Core's does).

All the checkpoints asked for are written by one child process (one ``import torch``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["gpt_dirs", "gpt_bytes"]


def gpt_bytes(hidden: int, layers: int, vocab: int) -> dict[str, int]:
    """``{"largest": ..., "total": ...}`` tensor bytes of a checkpoint :func:`gpt_dirs`
    writes."""
    ffn = 4 * hidden
    per_layer = (3 * hidden * hidden + hidden * hidden + 2 * ffn * hidden + ffn * hidden
                 + hidden) * 4
    return {"largest": max(vocab * hidden * 4, 2 * ffn * hidden * 4),
            "total": 2 * vocab * hidden * 4 + hidden * 4 + layers * per_layer}


def gpt_dirs(specs: dict[Path, dict[str, int]], timeout: float = 600) -> None:
    """Write a checkpoint at each path, of ``{"hidden": H, "layers": L, "vocab": V}``."""
    job = [{"root": str(root), **sizes} for root, sizes in specs.items()]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, __file__, json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def _save(root: Path, hidden: int, layers: int, vocab: int, seed: int) -> None:
    import argparse

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    gen = torch.Generator().manual_seed(seed)
    ffn = 4 * hidden

    def stacked(*local: int):
        shards = [Shard(torch.randn(1, *local, generator=gen),
                        ShardMetadata([n] + [0] * len(local), [1, *local], "rank:0/cpu"))
                  for n in range(layers)]
        return init_from_local_shards(shards, layers, *local)

    sd = {
        "embedding.word_embeddings.weight": torch.randn(vocab, hidden, generator=gen),
        "output_layer.weight": torch.randn(vocab, hidden, generator=gen),
        "decoder.final_layernorm.weight": torch.ones(hidden),
        "decoder.layers.self_attention.linear_qkv.weight": stacked(3 * hidden, hidden),
        "decoder.layers.self_attention.linear_proj.weight": stacked(hidden, hidden),
        "decoder.layers.mlp.linear_fc1.weight": stacked(2 * ffn, hidden),
        "decoder.layers.mlp.linear_fc2.weight": stacked(hidden, ffn),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": stacked(hidden),
    }
    root.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(root, thread_count=2, sync_files=False))
    args = argparse.Namespace(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              padded_vocab_size=vocab)
    torch.save({"args": args, "iteration": 100, "checkpoint_version": 3.0}, root / "common.pt")
    (root / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))


def _main(job: list[dict]) -> None:
    import torch.distributed as dist

    store = Path(job[0]["root"]).parent / ".pg-store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        for seed, spec in enumerate(job):
            _save(Path(spec["root"]), spec["hidden"], spec["layers"], spec["vocab"], seed)
    finally:
        dist.destroy_process_group()
        store.unlink(missing_ok=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
