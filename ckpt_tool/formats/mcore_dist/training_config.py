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

``reshard``/``convert`` carry these files into their output, saying what it holds
(:func:`bridge_run_config_for`, :func:`nemo_io_for`): the new parallel sizes, and for
Megatron-Bridge whether it holds RNG and optimizer state (``checkpoint.save_rng`` /
``save_optim``, which Bridge's ``load_checkpoint`` reads with ``model.tensor_model_parallel_size``
and ``pipeline_model_parallel_size`` to decide what to load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

__all__ = ["training_config", "RUN_CONFIG", "from_bridge_run_config", "from_nemo_context",
           "bridge_run_config_for", "nemo_io_for", "load_yaml", "load_json"]

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
        found = from_bridge_run_config(load_yaml(root / RUN_CONFIG))
        where = f"Megatron-Bridge {RUN_CONFIG}"
    elif root.name == "weights" and (root.parent / "context").is_dir():
        context = root.parent / "context"
        model = load_yaml(context / "model.yaml") if (context / "model.yaml").is_file() else {}
        graph = load_json(context / "io.json") if (context / "io.json").is_file() else {}
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


# Layout.to_dict() name -> Megatron-Core's TransformerConfig / NeMo MegatronStrategy argument
_LAYOUT_FIELDS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
                  "vpp": "virtual_pipeline_model_parallel_size",
                  "first_stage_layers": "num_layers_in_first_pipeline_stage",
                  "last_stage_layers": "num_layers_in_last_pipeline_stage"}


def bridge_run_config_for(config: Any, layout: Mapping[str, Any] | None, has_rng: bool,
                          has_optimizer: bool) -> tuple[Any, list[str]]:
    """A parsed ``run_config.yaml`` for the checkpoint written from it: ``model``'s parallel
    sizes those of ``layout`` (``Layout.to_dict()``; None: unchanged), ``checkpoint.save_rng`` /
    ``save_optim`` false when it holds no RNG / optimizer state. Returns the new config and
    what changed (``section.field=value``); fields the file does not hold are left out."""
    if not isinstance(config, Mapping):
        return config, []
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    changed: list[str] = []

    def put(section: str, name: str, value: Any) -> None:
        part = out.get(section)
        if isinstance(part, dict) and name in part and part[name] != value:
            part[name] = value
            changed.append(f"{section}.{name}={value}")

    for key, name in _LAYOUT_FIELDS.items():
        if layout is not None and key in layout:
            value = layout[key]
            put("model", name, None if key == "vpp" and (value or 1) == 1 else value)
    if not has_rng:
        put("checkpoint", "save_rng", False)
    if not has_optimizer:
        put("checkpoint", "save_optim", False)
    return out, changed


_STRATEGY = "<root>.trainer.strategy"
# MegatronStrategy's defaults (an argument left at its default is not in io.json)
_STRATEGY_DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                      "expert_model_parallel_size": 1}


def nemo_io_for(graph: Any, layout: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """A parsed NeMo ``context/io.json`` (a fiddle graph) whose ``MegatronStrategy`` has the
    parallel sizes of ``layout``: each leaf at ``<root>.trainer.strategy.<size>`` set, a size
    the strategy was not given (its default) added as an argument where ``layout`` differs
    from that default. Returns the new graph and what changed; unchanged (and nothing
    changed) when the graph has no strategy object."""
    import copy

    out = copy.deepcopy(graph)
    node = _strategy_node(out)
    if node is None:
        return graph, []
    items = node.setdefault("items", [])
    given = {}
    for item in items:
        leaf = item[1] if isinstance(item, list) and len(item) == 2 else None
        for path in (leaf.get("paths") or []) if isinstance(leaf, dict) else []:
            if str(path).startswith(_STRATEGY + "."):
                given[str(path)[len(_STRATEGY) + 1:]] = leaf
    changed: list[str] = []
    tp = layout.get("tp")
    for key, name in _LAYOUT_FIELDS.items():
        if key not in layout:
            continue
        value = layout[key]
        if key == "vpp" and (value or 1) == 1:
            value = None
        if name in given:
            if given[name].get("value") != value:
                given[name]["value"] = value
                changed.append(f"trainer.strategy.{name}={value}")
            continue
        default = _STRATEGY_DEFAULTS.get(name)
        if value == default or (key == "etp" and value == tp):
            continue
        items.append([f"Attr(name='{name}')",
                      {"type": "leaf", "value": value, "paths": [f"{_STRATEGY}.{name}"]}])
        _add_argument_name(node, name)
        changed.append(f"trainer.strategy.{name}={value}")
    return (out, changed) if changed else (graph, [])


def _strategy_node(graph: Any) -> dict[str, Any] | None:
    """The fiddle object reached at ``<root>.trainer.strategy``."""
    objects = graph.get("objects") if isinstance(graph, dict) else None
    for node in (objects or {}).values():
        if isinstance(node, dict) and _STRATEGY in (node.get("paths") or []):
            return node
    return None


def _add_argument_name(node: dict[str, Any], name: str) -> None:
    """Append ``name`` to the ``argument_names`` of a fiddle Config's metadata."""
    metadata = node.get("metadata")
    for item in (metadata or {}).get("items") or []:
        if isinstance(item, list) and len(item) == 2 and "argument_names" in str(item[0]):
            names = item[1].setdefault("items", []) if isinstance(item[1], dict) else None
            if names is not None:
                names.append([f"Index(index={len(names)})", name])


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


def load_yaml(path: Path) -> Any:
    import yaml

    from ckpt_tool.errors import CorruptCheckpointError

    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CorruptCheckpointError(f"{path.name} cannot be read as YAML "
                                     f"({str(exc).splitlines()[0]})", path=path) from None


def load_json(path: Path) -> Any:
    from ckpt_tool.errors import CorruptCheckpointError

    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path.name} is not valid JSON ({exc})",
                                     path=path) from None
