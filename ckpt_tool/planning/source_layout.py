"""What a checkpoint says about the layout it was saved with: ``args`` (or the readers'
``parallel`` summary, or the training configuration a reader found beside the checkpoint) first;
without them the global shape ``(pp, tp)`` of Megatron-LM's ``rng_state`` ShardedObjects, then
the tensor-parallel size from the chunk grids of the weights the layout rules split
(vocab-parallel along dim 0, row-parallel along the last dim), then the pipeline-parallel size
from the DistributedOptimizer's model-parallel domains (``dp_group_idx`` counts tp x pp). A
size nothing tells is reported as ``unknown``, never guessed."""

from __future__ import annotations

import re
from typing import Any, Mapping

from ckpt_tool.model import CheckpointMeta, is_optimizer_key
from ckpt_tool.planning.sizes import Layout

__all__ = ["args_of", "configured_args", "source_layout_from", "source_layout_origins",
           "optimizer_domains"]


def args_of(meta: CheckpointMeta, common: Mapping[str, Any] | None) -> dict[str, Any]:
    """The checkpoint's Megatron-LM ``args`` as a dict (empty without them)."""
    args: Any = None
    if common is not None:
        args = common.get("args")
    if args is None:
        args = meta.extras.get("args")
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    return dict(vars(args)) if hasattr(args, "__dict__") else {}


def configured_args(meta: CheckpointMeta, common: Mapping[str, Any] | None
                    ) -> tuple[dict[str, Any], str]:
    """The training configuration a checkpoint carries, in Megatron-LM's argument names, and
    where it came from: its ``args``, else what a reader found beside it
    (``extras["training_config"]``: Megatron-Bridge's ``run_config.yaml``, NeMo's context);
    ``({}, "")`` without any. Only the parallel layout and the DistributedOptimizer's buffers
    are taken from the latter: it is not a complete ``args``."""
    args = args_of(meta, common)
    if args:
        return args, "args"
    found = meta.extras.get("training_config") or {}
    return dict(found.get("args") or {}), str(found.get("source") or "")


def source_layout_from(meta: CheckpointMeta, common: Mapping[str, Any] | None = None) -> Layout:
    """The layout the checkpoint was saved with (``args`` / ``common["parallel"]``; without
    them tp from the chunk grids). A size nothing tells is 1 here: see
    :func:`source_layout_origins` for which sizes are known and from where."""
    values, _ = _source_layout(meta, common)
    return Layout(tp=int(values["tp"] or 1), pp=int(values["pp"] or 1),
                  ep=int(values["ep"] or 1), etp=values["etp"], vpp=values["vpp"],
                  first_stage_layers=values["first"], last_stage_layers=values["last"])


def source_layout_origins(meta: CheckpointMeta, common: Mapping[str, Any] | None = None
                          ) -> dict[str, str]:
    """Where each source size came from: ``args``, ``chunk grid`` or ``unknown`` (for tp, pp
    and ep)."""
    return _source_layout(meta, common)[1]


def _source_layout(meta: CheckpointMeta, common: Mapping[str, Any] | None
                   ) -> tuple[dict[str, Any], dict[str, str]]:
    args, where = configured_args(meta, common)
    par = meta.common.get("parallel", {}) if isinstance(meta.common, Mapping) else {}

    def get(long: str, short: str) -> Any:
        v = args.get(long)
        if v is None:
            v = par.get(short)
        if v is None:
            v = meta.extras.get(short)
        return v

    values = {"tp": get("tensor_model_parallel_size", "tp"),
              "pp": get("pipeline_model_parallel_size", "pp"),
              "ep": get("expert_model_parallel_size", "ep"),
              "etp": get("expert_tensor_parallel_size", "etp"),
              "vpp": get("virtual_pipeline_model_parallel_size", "vpp"),
              "first": args.get("decoder_first_pipeline_num_layers"),
              "last": args.get("decoder_last_pipeline_num_layers")}
    origins = {k: (where or "args") if values[k] is not None else "unknown"
               for k in ("tp", "pp", "ep")}
    rng = [o.global_shape for o in meta.objects
           if o.key == "rng_state" and len(o.global_shape) == 2]
    if rng and len(set(rng)) == 1:  # Megatron-LM's rng_state: global shape (pp, tp)
        for name, size in zip(("pp", "tp"), rng[0]):
            if values[name] is None:
                values[name], origins[name] = int(size), "rng_state objects"
    if values["tp"] is None:
        grid = _tp_from_chunk_grids(meta)
        if grid is not None:
            values["tp"], origins["tp"] = grid, "chunk grid"
    domains = optimizer_domains(meta)
    if values["pp"] is None and values["tp"] and domains and domains % int(values["tp"]) == 0:
        values["pp"], origins["pp"] = domains // int(values["tp"]), "optimizer domains"
    if values["ep"] is None and not any(".experts." in k or "local_experts" in k
                                        for k in meta.tensors):
        origins["ep"] = "no experts"
    return values, origins


_DENSE_DOMAIN = re.compile(r"^(?:chained_0\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.")


def optimizer_domains(meta: CheckpointMeta) -> int | None:
    """How many model-parallel domains (tp x pp) the DistributedOptimizer's dense state names
    (``dp_group_idx_*`` of its per-bucket tensors or objects; a view that rewrote them keeps
    the count in ``extras["optimizer_domains"]``); None without such state."""
    found = {int(m.group(1)) for k in [*meta.tensors, *(o.key for o in meta.objects)]
             if (m := _DENSE_DOMAIN.match(k))}
    return len(found) or meta.extras.get("optimizer_domains")


_ROW_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB_SPLIT = ("embedding.word_embeddings.weight", "output_layer.weight")


def _tp_from_chunk_grids(meta: CheckpointMeta) -> int | None:
    """tp from how the layout rules' TP-split weights are chunked: vocab-parallel ones along
    dim 0, row-parallel ones along their last dim (one chunk per tp rank); None unless every
    such tensor agrees."""
    seen: set[int] = set()
    for k, t in meta.tensors.items():
        if is_optimizer_key(k) or ".experts." in k or not t.chunks:
            continue
        if k.endswith(_VOCAB_SPLIT) and len(t.shape) == 2:
            axis = 0
        elif k.endswith(_ROW_SPLIT):
            axis = len(t.shape) - 1
        else:
            continue
        seen.add(len({c.offsets[axis] for c in t.chunks}))
    return seen.pop() if len(seen) == 1 else None
