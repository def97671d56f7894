"""What a checkpoint holds, read from its metadata alone: the model's sizes and the form of
its optimizer state.

:func:`model_sizes_from` takes Megatron-LM's ``args`` when the checkpoint has them and fills
the gaps from tensor shapes; :func:`optimizer_info_from` names the optimizer state's form (a
Megatron-Core ``distrib_optim_sharding_type``, the non-distributed optimizers' model-space
state, or a legacy checkpoint's files) from the keys. ``feasibility`` and ``reshard`` decide
from these what a target layout can hold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from ckpt_tool.model import CheckpointMeta, is_optimizer_key, split_chained
from ckpt_tool.planning.sizes import ModelSizes
from ckpt_tool.planning.source_layout import args_of

__all__ = ["OptimizerInfo", "optimizer_info_from", "model_sizes_from", "NON_DISTRIBUTED",
           "RESHARDABLE_OPTIMIZERS", "DP_ONLY_OPTIMIZERS"]

NON_DISTRIBUTED = "non_distributed"
RESHARDABLE_OPTIMIZERS = ("fully_reshardable", "fully_sharded_model_space", NON_DISTRIBUTED)
DP_ONLY_OPTIMIZERS = ("dp_reshardable", "dp_zero_gather_scatter", "legacy_distrib_optim",
                      "legacy_optimizer")


@dataclass(frozen=True)
class OptimizerInfo:
    """Which optimizer state the checkpoint holds: ``sharding`` is a Megatron-Core
    ``distrib_optim_sharding_type``, ``non_distributed`` (model-space
    ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<model key>`` of
    ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``), ``legacy_distrib_optim``
    (``distrib_optim.pt`` files), ``legacy_optimizer`` (per-rank ``optimizer`` entries) or None
    (no optimizer state); ``claimed`` is what the content metadata says."""

    sharding: str | None = None
    keys: tuple[str, ...] = ()
    claimed: str | None = None
    source: str | None = None

    def describe(self) -> str:
        """One phrase naming the form found."""
        return _FORM_NAMES.get(self.sharding or "", self.sharding or "no optimizer state")

    def to_dict(self) -> dict[str, Any]:
        return {"form": self.sharding, "description": self.describe(),
                "tensors": len(self.keys), "content_metadata_says": self.claimed}


_FORM_NAMES = {
    "non_distributed": "non-distributed optimizer (Float16OptimizerWithFloat16Params / "
                       "FP32Optimizer), model-space optimizer.state.* keys",
    "fully_reshardable": "DistributedOptimizer, fully_reshardable (model space)",
    "fully_sharded_model_space": "DistributedOptimizer, fully_sharded_model_space (flattened)",
    "dp_reshardable": "DistributedOptimizer, dp_reshardable (per-bucket flat buffers)",
    "dp_zero_gather_scatter": "DistributedOptimizer, dp_zero_gather_scatter (param_state "
                              "object)",
    "legacy_distrib_optim": "legacy distrib_optim.pt files (DistributedOptimizer)",
    "legacy_optimizer": "legacy per-rank optimizer entries"}


def _find_shape(meta: CheckpointMeta, suffix: str) -> tuple[int, ...] | None:
    for k, t in meta.tensors.items():
        if not is_optimizer_key(k) and k.endswith(suffix):
            return t.shape
    return None


def model_sizes_from(meta: CheckpointMeta, common: Mapping[str, Any] | None = None
                     ) -> ModelSizes:
    """Model sizes from ``args`` (the full common state's, the legacy reader's
    ``extras["args"]`` or the ``common["model"]`` summary), completed from tensor shapes."""
    args = args_of(meta, common)
    summary = meta.common.get("model", {}) if isinstance(meta.common, Mapping) else {}

    def get(name: str) -> Any:
        v = args.get(name)
        return summary.get(name) if v is None else v

    emb = _find_shape(meta, "word_embeddings.weight") or _find_shape(meta, "output_layer.weight")
    fc2 = _find_shape(meta, "mlp.linear_fc2.weight")
    fc1 = _find_shape(meta, "mlp.linear_fc1.weight")
    num_layers = get("num_layers")
    if num_layers is None:
        num_layers = _layers_from_keys(meta)
    hidden = get("hidden_size") or (emb[-1] if emb else None)
    ffn = get("ffn_hidden_size") or (fc2[-1] if fc2 else None)
    gated = get("swiglu")
    if gated is None:
        gated = bool(fc1 and ffn and fc1[-2] == 2 * ffn)
    heads = get("num_attention_heads")
    groups = get("num_query_groups") if get("group_query_attention") is not False else None
    groups = groups or heads
    kv = get("kv_channels") or (hidden // heads if hidden and heads else None)
    experts = get("num_experts") or get("num_moe_experts")
    padded = get("padded_vocab_size") or (emb[0] if emb else None)
    return ModelSizes(
        num_layers=num_layers, hidden_size=hidden, ffn_hidden_size=ffn,
        num_attention_heads=heads, num_query_groups=groups, kv_channels=kv,
        padded_vocab_size=padded, vocab_size=_tokenizer_vocab(args, padded),
        make_vocab_size_divisible_by=int(get("make_vocab_size_divisible_by") or 128),
        gated_linear_unit=bool(gated), num_experts=experts,
        moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
        attention_output_gate=bool(get("attention_output_gate")))


def _tokenizer_vocab(args: Mapping[str, Any], padded: int | None) -> int | None:
    """The vocabulary Megatron-LM padded the embedding from: ``args.vocab_size`` (``--vocab-size``),
    plus the end-of-document token (id V) its ``NullTokenizer`` of ``--vocab-size V`` adds, when
    the padded vocab holds it (as Megatron-LM's own tokenizer build makes it; args written by
    hand may have padded V tokens)."""
    vocab = args.get("vocab_size")
    if vocab is None:
        return None
    null = args.get("tokenizer_type") == "NullTokenizer"
    return int(vocab) + 1 if null and (padded is None or int(padded) > int(vocab)) else int(vocab)


def _layers_from_keys(meta: CheckpointMeta) -> int | None:
    best = None
    for k, t in meta.tensors.items():
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", k)
        if m:
            best = max(best or 0, int(m.group(1)) + 1)
        elif re.search(r"(?:^|\.)decoder\.layers\.[a-z]", k) and t.shape:
            best = max(best or 0, t.shape[0])
    return best


def optimizer_info_from(meta: CheckpointMeta) -> OptimizerInfo:
    """The optimizer state kind of ``meta`` (see :class:`OptimizerInfo`), from its keys: the
    Megatron-Core readers' ``extras["optimizer_sharding"]`` (None for a model-only checkpoint,
    whatever its content metadata declares), else the legacy reader's objects."""
    keys = tuple(k for k in meta.tensors if split_chained(k)[1].startswith("optimizer."))
    cm = meta.common.get("content_metadata") if isinstance(meta.common, Mapping) else None
    claimed = cm.get("distrib_optim_sharding_type") if isinstance(cm, Mapping) else None
    claimed = None if claimed is None else str(claimed)
    if "optimizer_sharding" in meta.extras:
        found = meta.extras.get("optimizer_sharding") or {}
        return OptimizerInfo(found.get("type"), keys, found.get("declared") or claimed,
                             found.get("source"))
    sharding = None
    if any(o.key == "distrib_optim" for o in meta.objects):
        sharding = "legacy_distrib_optim"
    elif any(o.key == "optimizer" for o in meta.objects):
        sharding = "legacy_optimizer"
    elif any(split_chained(o.key)[1].startswith("optimizer.distributed.") for o in meta.objects):
        sharding = "dp_zero_gather_scatter"
    elif any(split_chained(k)[1].startswith("optimizer.distributed.") for k in keys):
        sharding = "dp_reshardable"
    elif keys:
        sharding = ("fully_reshardable" if any(k.startswith("optimizer.state.param.")
                                               for k in keys) else "non_distributed")
    return OptimizerInfo(sharding, keys, claimed)
