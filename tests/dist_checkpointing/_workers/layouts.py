"""A small, deterministic "model" sharded like Megatron-Core shards a GPT layer stack.

The same builder serves both libraries: ``mapping`` is either Megatron-Core's
``megatron.core.dist_checkpointing.mapping`` or ours (they share the API), so a checkpoint
written by one can be checked against values requested through the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_LAYERS = 4
HIDDEN = 8
FFN = 12


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one rank: tensor-, pipeline- and data-parallel coordinates."""

    tp: int
    pp: int
    dp: int
    rank: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return (self.rank // self.tp) % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)


def parse_layout(spec: str, rank: int, world: int) -> Layout:
    """``"tp2pp2"`` → Layout; dp is what is left of ``world``."""
    tp = int(spec.split("tp")[1].split("pp")[0])
    pp = int(spec.split("pp")[1])
    if world % (tp * pp):
        raise ValueError(f"world {world} not divisible by tp*pp of {spec}")
    return Layout(tp, pp, world // (tp * pp), rank)


def global_tensors() -> dict:
    """Full values of every sharded tensor (same on every process)."""
    g = torch.Generator().manual_seed(1234)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "embedding.word_embeddings.weight": rnd(16, HIDDEN),
        "decoder.layers.self_attention.linear_qkv.weight": rnd(NUM_LAYERS, 3 * HIDDEN, HIDDEN),
        "decoder.layers.self_attention.linear_proj.weight": rnd(
            NUM_LAYERS, HIDDEN, HIDDEN, dtype=torch.bfloat16
        ),
        "decoder.layers.mlp.linear_fc1.weight": rnd(NUM_LAYERS, FFN, HIDDEN, dtype=torch.bfloat16),
        "decoder.layers.input_layernorm.weight": rnd(NUM_LAYERS, HIDDEN),
        "decoder.final_layernorm.weight": rnd(HIDDEN),
        "output_layer.weight": rnd(16, HIDDEN, dtype=torch.bfloat16),
        "step_counter": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }


# how each stacked-layer tensor splits along tensor parallelism: local axis or None (replicated)
_LAYER_TP_AXIS = {
    "decoder.layers.self_attention.linear_qkv.weight": 0,
    "decoder.layers.self_attention.linear_proj.weight": 1,
    "decoder.layers.mlp.linear_fc1.weight": 0,
    "decoder.layers.input_layernorm.weight": None,
}


def _chunk(t: torch.Tensor, axis: int, n: int, i: int) -> torch.Tensor:
    return t.chunk(n, dim=axis)[i].clone()


def build_sharded_state_dict(mapping, layout: Layout, with_objects: bool = True,
                             empty: bool = False) -> dict:
    """Sharded state dict of ``layout``'s rank built with ``mapping`` (MCore's or ours).

    ``empty`` gives zero-filled local tensors (a load target).
    """
    ST = mapping.ShardedTensor
    full = global_tensors()
    tp, tpr, pp, ppr, dpr = layout.tp, layout.tp_rank, layout.pp, layout.pp_rank, layout.dp_rank

    def prep(t):
        return torch.zeros_like(t) if empty else t

    sd = {}
    # vocab-parallel: split along dim 0 (first stage / last stage hold them in real models)
    if ppr == 0:
        sd["embedding"] = {"word_embeddings.weight": ST.from_rank_offsets(
            "embedding.word_embeddings.weight",
            prep(_chunk(full["embedding.word_embeddings.weight"], 0, tp, tpr)),
            (0, tpr, tp), replica_id=dpr)}
    if ppr == pp - 1:
        sd["output_layer.weight"] = ST.from_rank_offsets(
            "output_layer.weight", prep(_chunk(full["output_layer.weight"], 0, tp, tpr)),
            (0, tpr, tp), replica_id=dpr)
        sd["final_layernorm.weight"] = ST.from_rank_offsets(
            "decoder.final_layernorm.weight", prep(full["decoder.final_layernorm.weight"].clone()),
            replica_id=(0, tpr, dpr))
    # stacked layers: local layer i of stage p is global layer p * per_stage + i
    per_stage = NUM_LAYERS // pp
    layers = {}
    for i in range(per_stage):
        gl = ppr * per_stage + i
        for key, axis in _LAYER_TP_AXIS.items():
            layer = full[key][gl]
            if axis is None:
                local, offsets, rep = layer.clone(), (), (0, tpr, dpr)
            else:
                local, offsets, rep = _chunk(layer, axis, tp, tpr), ((axis + 1, tpr, tp),), (0, 0, dpr)
            layers[f"{i}.{key.rsplit('decoder.layers.', 1)[1]}"] = ST.from_rank_offsets(
                key, prep(local), (0, gl, NUM_LAYERS), *offsets, replica_id=rep,
                prepend_axis_num=1)
    sd["decoder"] = {"layers": layers}
    # replicated everywhere, int64
    sd["step_counter"] = ST.from_rank_offsets(
        "step_counter", prep(full["step_counter"].clone()), replica_id=layout.rank)
    if with_objects:
        # keyed by (pp, tp) like rng_state: only loadable at the same layout
        sd["rng_state"] = mapping.ShardedObject(
            "rng_state", None if empty else {"seed": 100 * ppr + tpr, "tp": tpr, "pp": ppr},
            (pp, tp), (ppr, tpr), replica_id=dpr)
    # a single global object: loadable at any layout
    sd["extra"] = mapping.ShardedObject(
        "model_extra", None if empty else {"note": "hello", "values": [1, 2, 3]},
        (1,), (0,), replica_id=layout.rank)
    return sd


def common_state() -> dict:
    """Non-sharded values saved to common.pt."""
    return {"iteration": 10, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 12.5,
            "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 80}}


def expected_object(key: str, layout: Layout):
    """Value a ShardedObject of ``key`` must load as."""
    if key == "rng_state":
        return {"seed": 100 * layout.pp_rank + layout.tp_rank, "tp": layout.tp_rank,
                "pp": layout.pp_rank}
    return {"note": "hello", "values": [1, 2, 3]}
