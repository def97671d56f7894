"""Write a synthetic GPT-shaped torch_dist checkpoint of a given size with the REAL Megatron-Core.

Run under torchrun (gloo, CPU)::

    CUDA_VISIBLE_DEVICES= torchrun --nproc-per-node 2 bench/make_synthetic.py OUT --size-mb 500

Each rank is one tensor-parallel rank (TP = world size, PP = 1). Tensors follow Megatron-Core's
GPT naming and sharding: stacked layers (``prepend_axis_num=1``), column-parallel QKV/fc1 split
along dim 0, row-parallel proj/fc2 split along dim 1, replicated norms, vocab-parallel embedding
and output layer. ``--layers`` and ``--hidden`` are chosen from ``--size-mb`` unless given.
"""

from __future__ import annotations

import argparse
import os
import sys


def _patch_cuda_for_cpu(torch) -> None:
    # docs/formats.md §8: the calls Megatron-Core's torch_dist save makes that need a GPU.
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _dims(size_mb: int, hidden: int | None, layers: int | None) -> tuple[int, int, int]:
    hidden = hidden or 512
    ffn, vocab = 4 * hidden, 16384
    per_layer = (3 * hidden * hidden + hidden * hidden + 2 * ffn * hidden + ffn * hidden + 4 * hidden) * 4
    fixed = 2 * vocab * hidden * 4
    layers = layers or max(1, (size_mb * 2**20 - fixed) // per_layer)
    return hidden, layers, vocab


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--size-mb", type=int, default=500)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--load-from", help="Megatron-Core's reshard path: build the state dict at "
                    "this world size, load it from this checkpoint, save it to OUT")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    _patch_cuda_for_cpu(torch)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    hidden, layers, vocab = _dims(a.size_mb, a.hidden, a.layers)
    ffn = 4 * hidden
    gen = torch.Generator().manual_seed(1234 + rank)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def stacked(key, local, axis, replicated=False):
        out = []
        for layer in range(layers):
            t = rand(*local)
            rank_offsets = [(0, layer, layers)]
            if not replicated:
                rank_offsets.append((axis + 1, rank, tp))
            out.append(ShardedTensor.from_rank_offsets(
                key, t, *rank_offsets, replica_id=rank if replicated else 0, prepend_axis_num=1))
        return out

    sd = {
        "embedding": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", rand(vocab // tp, hidden), (0, rank, tp)),
        "output": ShardedTensor.from_rank_offsets(
            "output_layer.weight", rand(vocab // tp, hidden), (0, rank, tp)),
        "final_norm": ShardedTensor.from_rank_offsets(
            "decoder.final_layernorm.weight", torch.ones(hidden), replica_id=rank),
        "qkv": stacked("decoder.layers.self_attention.linear_qkv.weight", (3 * hidden // tp, hidden), 0),
        "proj": stacked("decoder.layers.self_attention.linear_proj.weight", (hidden, hidden // tp), 1),
        "fc1": stacked("decoder.layers.mlp.linear_fc1.weight", (2 * ffn // tp, hidden), 0),
        "fc2": stacked("decoder.layers.mlp.linear_fc2.weight", (hidden, ffn // tp), 1),
        "norm": stacked("decoder.layers.self_attention.linear_qkv.layer_norm_weight", (hidden,), 0, True),
        "rng_state": ShardedObject("rng_state", {"seed": rank}, (1, tp), (0, rank), replica_id=0),
        "args": argparse.Namespace(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                                   tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                   padded_vocab_size=vocab),
        "iteration": 100,
        "checkpoint_version": 3.0,
    }
    if a.load_from:
        sd.pop("rng_state")  # keyed by the old layout
        sharded = {k: sd[k] for k in ("embedding", "output", "final_norm", "qkv", "proj", "fc1",
                                      "fc2", "norm")}
        loaded = dist_checkpointing.load(sharded, a.load_from)
        for k, v in sharded.items():
            for sh, t in zip(v if isinstance(v, list) else [v],
                             loaded[k] if isinstance(v, list) else [loaded[k]]):
                sh.data = t
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, a.out)
    dist.barrier()
    if rank == 0:
        print(f"wrote {a.out}: {layers} layers, hidden {hidden}, tp {tp}", file=sys.stderr)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
