"""The HF conversions of families whose layers differ (``planning.hf_families``): config.json
<-> Megatron-LM ``args`` and the recipes of ``planning.hf_layered``; ``_hf.convert_hf`` runs
them as every HF conversion."""

from __future__ import annotations

import argparse
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.planning.hf_families import Family
from ckpt_tool.planning.hf_layered import (EXPERT_LAYOUTS, mtp_layers_in, plan_layered_export,
                                           plan_layered_import)
from ckpt_tool.planning.hf_plan import Recipe
from ckpt_tool.planning.hf_rules import padded_vocab

__all__ = ["export_layered", "import_layered"]

_DTYPES = ("float32", "bfloat16", "float16")


def _experts_layout(options: Any, args: dict[str, Any]) -> str:
    layout = options.hf_experts or args.get("hf_experts") or "per-expert"
    if layout not in EXPERT_LAYOUTS:
        raise UsageError(f"--hf-experts {layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}",
                         hint="per-expert (transformers' save_pretrained default) or fused")
    return layout


def export_layered(meta: CheckpointMeta, args: dict[str, Any], family: Family,
                   base: dict[str, Any], options: Any, *, vocab: int, settings: str
                   ) -> tuple[list[Recipe], dict[str, Any]]:
    """Recipes and config.json of ``--to hf`` for ``family``."""
    recipes = plan_layered_export(meta, args, family, vocab=vocab,
                                  experts_layout=_experts_layout(options, args),
                                  settings=settings)
    dtype = next((r.dtype for r in recipes if r.key == family.embed), recipes[0].dtype)
    config = {"architectures": [family.architecture], "model_type": family.model_type,
              **family.config_from_args(args), "vocab_size": int(vocab),
              "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights",
                                                  False),
              "torch_dtype": dtype, "use_cache": True, **base}
    return recipes, config


def import_layered(meta: CheckpointMeta, config: dict[str, Any], family: Family, options: Any,
                   tp: int, pp: int) -> tuple[list[Recipe], dict[str, Any], list[str]]:
    """Recipes, Megatron-LM ``args`` and notes of an HF -> torch_dist/legacy import."""
    from ckpt_tool.errors import InputError

    layers = int(config["num_hidden_layers"])
    for need in family.config_needs:
        if config.get(need) is None:
            raise InputError(f"{family.architecture} config.json names no {need}",
                             hint="fix config.json or pass --hf-config")
    mtp = mtp_layers_in(meta, family, layers)
    vocab = int(config["vocab_size"])
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    dtype = dtype if dtype in _DTYPES else "float32"
    seq = int(config.get("max_position_embeddings") or 2048)
    args = {**family.args_from_config(config, mtp),
            "max_position_embeddings": seq, "seq_length": seq,
            "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
            "vocab_size": vocab, "make_vocab_size_divisible_by": 128,
            "padded_vocab_size": padded_vocab(vocab, 128, tp),
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1,
            "context_parallel_size": 1,
            "transformer_impl": "local" if options.local_spec else "transformer_engine",
            "params_dtype": dtype, "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
            "ckpt_format": "torch_dist", "tokenizer_type": "HuggingFaceTokenizer",
            "hf_architecture": family.architecture}
    for what in ("num_attention_heads", "num_query_groups"):
        if int(args.get(what) or 1) % tp:
            raise UsageError(f"--tp {tp} does not divide {what} {args[what]}",
                             hint="pick a TP size that divides the heads and query groups")
    if layers % pp:
        raise UsageError(f"--pp {pp} does not divide the {layers} layers",
                         hint="pick a PP size that divides the layer count")
    recipes, notes = plan_layered_import(meta, config, family, args,
                                         spec="local" if options.local_spec else "te")
    if any(k.endswith("mlp.experts.gate_up_proj") for k in meta.tensors):
        args["hf_experts"] = "fused"  # an export writes them as the source had them
    if int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0) > mtp:
        notes.append(f"config.json names {config.get('num_nextn_predict_layers') or config.get('num_mtp_layers')} "
                     f"MTP layer(s), the weights hold {mtp}: imported {mtp}")
    return recipes, args, notes


def namespace(args: dict[str, Any], tp: int, pp: int, dp: int = 1) -> argparse.Namespace:
    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

    return argparse.Namespace(**{**args, "params_dtype": torch_dtype(args["params_dtype"]),
                                 "world_size": tp * pp * dp, "data_parallel_size": dp})
