"""Hugging Face architectures whose decoder layers differ from one another (dense layers, then
mixture-of-experts layers; a Multi-Token-Prediction layer after the last): one module per
family, each pure data (name tables) plus its config.json <-> Megatron-LM ``args`` mapping.

Megatron-Core saves such models per layer (``TransformerBlock.sharded_state_dict`` treats a
``moe_layer_freq`` list as non-homogeneous layers): ``decoder.layers.{i}.<name>``, the routed
experts of layer ``i`` as one ``decoder.layers.{i}.mlp.experts.experts.<linear>.weight``
``[experts, ...]`` tensor, the MTP layer ``j`` as ``mtp.layers.{j}.<name>`` with its decoder
layer below ``mtp.layers.{j}.transformer_layer.``. :mod:`ckpt_tool.planning.hf_layered` turns
a family into per-tensor recipes.

Each table row (:class:`Entry`) maps one Megatron-Core tensor (its name in the local layer spec,
and in the Transformer-Engine spec where that differs) to the HF tensor(s) it is made of, with
one transform: ``copy``, ``glu`` (HF gate, up <-> ``[gate; up]``), ``rope_q``/``rope_kv`` (the
rotary rows of an MLA projection, reordered when the HF checkpoint's rotary dimensions are not
interleaved; see the DeepSeek-V3 module), ``qkv`` (q/k/v <-> ``linear_qkv`` per query group);
fused experts: ``glu_interleaved`` / ``glu_interleaved_t`` (GPT-OSS: gate and up interleaved
along the last dimension; ``_t``: then the last two dimensions swapped), ``swap_last``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Entry", "Family"]


@dataclass(frozen=True)
class Entry:
    """One Megatron-Core tensor of a layer and the HF tensor(s) it comes from."""

    mcore: str  # below the layer prefix; the local layer spec's name
    hf: tuple[str, ...]  # below the HF layer prefix (``{e}``: the expert)
    op: str = "copy"
    te: str = ""  # the Transformer-Engine spec's name, where it differs
    when: str = ""  # a feature the tensor exists under (``Family.features``)

    def name(self, spec: str) -> str:
        return self.te if spec == "te" and self.te else self.mcore


@dataclass(frozen=True)
class Family:
    """One HF architecture with per-layer differences."""

    name: str
    architecture: str
    model_type: str
    attention: tuple[Entry, ...]  # every decoder layer (and MTP layer)
    dense: tuple[Entry, ...]  # the MLP of a dense layer
    moe: tuple[Entry, ...]  # router, shared experts of an MoE layer
    experts: tuple[Entry, ...]  # routed experts, HF one tensor per expert (``{e}``)
    experts_fused: tuple[Entry, ...]  # routed experts, HF ``[experts, ...]`` tensors
    mtp: tuple[Entry, ...] = ()  # below ``mtp.layers.{j}.`` (enorm, hnorm, eh_proj, ...)
    mtp_shared: tuple[tuple[str, str], ...] = ()  # (HF leaf, Megatron tensor it copies)
    args_from_config: Callable[..., dict[str, Any]] = field(default=None, repr=False)
    config_from_args: Callable[..., dict[str, Any]] = field(default=None, repr=False)
    features: Callable[[dict[str, Any]], set[str]] = field(default=None, repr=False)
    check_config: Callable[..., None] = field(default=None, repr=False)
    expected_shapes: Callable[..., dict[str, tuple[int, ...]]] = field(default=None, repr=False)
    rope_params: Callable[..., tuple[tuple[str, int], ...]] = field(default=None, repr=False)
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm.weight"
    lm_head: str = "lm_head.weight"
    layer_prefix: str = "model.layers.{i}."
    # config.json fields an import cannot do without
    config_needs: tuple[str, ...] = ("n_routed_experts", "num_experts_per_tok",
                                     "moe_intermediate_size")
