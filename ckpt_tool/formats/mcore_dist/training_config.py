"""The training configuration that frameworks keep beside a Megatron-Core dist checkpoint whose
common state has no Megatron-LM ``args``, in Megatron-LM's argument names (docs/optimizer.md).

- Megatron-Bridge writes ``run_config.yaml`` into the iteration directory: its
  ``ConfigContainer`` as YAML (``yaml.safe_dump``; each section a mapping with a ``_target_``
  class name). ``model`` holds the model provider's fields (Megatron-Core's ``TransformerConfig``
  names plus ``share_embeddings_and_output_weights`` and ``transformer_layer_spec``, a
  ``{_target_: <function>}`` mapping), ``ddp`` the ``DistributedDataParallelConfig`` that
  Megatron-Core's DDP set in place (its effective ``bucket_size``: None when
  ``overlap_grad_reduce`` is off). The data-parallel size is not in it.
- NeMo 2 keeps the dist checkpoint in ``<checkpoint>/weights/`` and its configuration in
  ``<checkpoint>/context/``: ``model.yaml`` (the model config with its defaults under
  ``config``) and ``io.json`` (the trainer's construction arguments as a fiddle graph: the
  parallel sizes given to ``MegatronStrategy``). NeMo may change its DDP settings after
  construction (communication-overlap callbacks), so its bucket settings are not taken.

Only values the files hold are returned; nothing is defaulted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["training_config", "RUN_CONFIG", "from_bridge_run_config", "from_nemo_context"]

RUN_CONFIG = "run_config.yaml"
_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
          "virtual_pipeline_model_parallel_size", "context_parallel_size",
          "expert_model_parallel_size", "expert_tensor_parallel_size")
# TransformerConfig / model provider field -> Megatron-LM argument (same name when absent)
_MODEL = {**{k: k for k in _SIZES + (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "moe_ffn_hidden_size", "make_vocab_size_divisible_by", "seq_length")},
    "num_moe_experts": "num_experts", "gated_linear_unit": "swiglu",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers"}
_DDP = {"overlap_grad_reduce": "overlap_grad_reduce", "bucket_size": "ddp_bucket_size",
        "pad_buckets_for_high_nccl_busbw": "ddp_pad_buckets_for_high_nccl_busbw",
        "use_distributed_optimizer": "use_distributed_optimizer"}
# layer-spec functions (Megatron-Bridge's gpt_provider, NeMo's gpt model base) -> transformer_impl
_SPECS = {"local_layer_spec": "local", "transformer_engine_layer_spec": "transformer_engine",
          "default_layer_spec": "transformer_engine"}


def training_config(root: Path) -> dict[str, Any] | None:
    """``{"source": what was read, "args": {Megatron-LM name: value}}`` from the files beside
    the checkpoint directory ``root``; None when there are none (or they hold nothing)."""
    if (root / RUN_CONFIG).is_file():
        found = from_bridge_run_config(_load_yaml(root / RUN_CONFIG))
        where = f"Megatron-Bridge {RUN_CONFIG}"
    elif root.name == "weights" and (root.parent / "context").is_dir():
        context = root.parent / "context"
        model = _load_yaml(context / "model.yaml") if (context / "model.yaml").is_file() else {}
        graph = _load_json(context / "io.json") if (context / "io.json").is_file() else {}
        found = from_nemo_context(model, graph)
        where = "NeMo context/model.yaml and io.json"
    else:
        return None
    return {"source": where, "args": found} if found else None


def from_bridge_run_config(config: Any) -> dict[str, Any]:
    """Megatron-LM arguments from a parsed Megatron-Bridge ``run_config.yaml``."""
    if not isinstance(config, Mapping):
        return {}
    out = _model_args(config.get("model"))
    ddp = config.get("ddp")
    if isinstance(ddp, Mapping):
        out.update({arg: ddp[k] for k, arg in _DDP.items() if k in ddp and _plain(ddp[k])})
    return out


def from_nemo_context(model: Any, graph: Any) -> dict[str, Any]:
    """Megatron-LM arguments from NeMo 2's parsed ``context/model.yaml`` (the model config
    under ``config``) and ``context/io.json`` (the strategy's parallel sizes)."""
    out = _model_args(model.get("config") if isinstance(model, Mapping) else None)
    leaves = _fiddle_leaves(graph)
    for name in _SIZES:
        value = leaves.get(f"<root>.trainer.strategy.{name}")
        if _plain(value) and value is not None:
            out[name] = value
    return out


def _model_args(model: Any) -> dict[str, Any]:
    if not isinstance(model, Mapping):
        return {}
    out = {arg: model[k] for k, arg in _MODEL.items() if k in model and _plain(model[k])}
    share = model.get("share_embeddings_and_output_weights")
    if isinstance(share, bool):
        out["untie_embeddings_and_output_weights"] = not share
    spec = model.get("transformer_layer_spec")
    target = spec.get("_target_") if isinstance(spec, Mapping) else None
    impl = _SPECS.get(str(target).rsplit(".", 1)[-1]) if target else None
    if impl and not model.get("use_transformer_engine_full_layer_spec"):
        out["transformer_impl"] = impl
    return out


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _fiddle_leaves(graph: Any) -> dict[str, Any]:
    """``{path: value}`` of every leaf of a fiddle JSON graph (``{"type": "leaf", "value",
    "paths"}`` items), e.g. ``<root>.trainer.strategy.tensor_model_parallel_size``."""
    out: dict[str, Any] = {}
    stack = [graph]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "leaf" and isinstance(node.get("paths"), list):
                for path in node["paths"]:
                    out[str(path)] = node.get("value")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def _load_yaml(path: Path) -> Any:
    import yaml

    from ckpt_tool.errors import CorruptCheckpointError

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CorruptCheckpointError(f"{path.name} cannot be read as YAML "
                                     f"({str(exc).splitlines()[0]})", path=path) from None


def _load_json(path: Path) -> Any:
    from ckpt_tool.errors import CorruptCheckpointError

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path.name} is not valid JSON ({exc})",
                                     path=path) from None
