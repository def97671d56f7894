"""Megatron-Core's ``_extra_state`` ShardedObjects of a GPT checkpoint (pure, no torch).

A module whose class defines ``get_extra_state`` adds ``<module>._extra_state`` to its
``state_dict``; Megatron-Core's ``make_sharded_tensors_for_checkpoint`` saves it as a
ShardedObject whose global shape and offset are the module's stacked axes (the layer axis of
``decoder.layers.*``, then the global-expert axis of routed experts), and ``(1,)``/``(0,)`` for
a module without any (docs/formats.md §13)::

    decoder.layers.self_attention.linear_proj._extra_state/shard_{layer}_{num_layers}
    decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{layer}.{expert}_{L}.{E}
    decoder.final_layernorm._extra_state/shard_0_1            (Transformer-Engine norms only)

``GPTModel.sharded_state_dict`` leaves out ``output_layer._extra_state``. Every one of them is a
key of the model's sharded state dict, so Megatron-LM's default load strictness
(``assume_ok_unexpected``) needs them all in the checkpoint. Which modules have one depends on
the layer spec:

* ``local`` (``--transformer-impl local``): the tensor-parallel linears (``linear_qkv``,
  ``linear_proj``, ``linear_fc1``, ``linear_fc2``, also of the experts and shared experts);
  their ``get_extra_state`` returns ``None``. The layers' norms and the embeddings have none.
* ``te`` (Transformer Engine): the same linears and every ``TENorm`` (``final_layernorm``, a MoE
  layer's separate ``pre_mlp_layernorm``, ``q_layernorm``/``k_layernorm``); without FP8 state
  Transformer Engine 2.9-2.11 (the versions Megatron-Core 0.16 requires) return an empty
  ``uint8`` tensor for both kinds. A norm fused into a linear (``linear_qkv.layer_norm_weight``)
  belongs to the linear's module.
* the final norm of a dense model: Megatron-LM builds dense GPTs from a layer spec, and
  ``TransformerBlock`` then makes ``final_layernorm`` a ``TENorm`` wherever Transformer Engine is
  installed, in the local spec too (MoE models get a block spec whose final norm follows the
  spec). It is written for both specs: a model built without Transformer Engine does not ask
  for it, which the default strictness allows.

Megatron-LM legacy files (``--ckpt-format torch``) hold the same entries per layer in each
``model`` state dict, ``output_layer._extra_state`` too (:func:`legacy_extra_states`).

Modules are found by their parameters: a linear by its ``<module>.weight`` (2-D per layer), a
norm by ``<module>.weight`` (1-D per layer); the stacked axes are the dimensions in front.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from ckpt_tool.model import ObjectMeta, TensorMeta, is_optimizer_key

__all__ = ["LOCAL", "TE", "SPECS", "EXTRA_STATE", "NONE", "EMPTY_UINT8", "extra_state_objects",
           "legacy_extra_states", "payload_kind", "legacy_layer_spec"]

LOCAL, TE = "local", "te"
SPECS = (LOCAL, TE)
EXTRA_STATE = "_extra_state"
NONE, EMPTY_UINT8 = "none", "empty_uint8"  # payload kinds: see payload_kind

# Megatron-Core's linear modules of a GPT layer (dense, experts, shared experts, MLA, the
# MTP layers' eh_proj).
_LINEARS = {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj",
            "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
            "linear_kv_up_proj", "eh_proj"}
# The norm modules that are TENorm in the Transformer-Engine spec.
_NORMS = {"final_layernorm", "input_layernorm", "pre_mlp_layernorm", "q_layernorm",
          "k_layernorm", "enorm", "hnorm"}
_OUTPUT_LAYER = "output_layer"  # a ColumnParallelLinear in both specs
_FINAL_NORM = "decoder.final_layernorm"
_MODEL_PREFIX = re.compile(r"^(?:decoder|encoder|mtp)\.")
_LAYER_NORM = re.compile(r"(?:^|\.)(?:decoder|encoder)\.layers\.(?:\d+\.)?input_layernorm\.")


def _module_of(key: str) -> tuple[str, int] | None:
    """``(module, its own number of dimensions)`` of a parameter key that belongs to a module
    with extra state in some spec (linears 2, norms 1), else None."""
    if not key.endswith(".weight") or is_optimizer_key(key):
        return None
    module = key[:-len(".weight")]
    if module == _OUTPUT_LAYER:
        return module, 2
    if not _MODEL_PREFIX.match(key):
        return None
    name = module.rsplit(".", 1)[-1]
    if name in _LINEARS:
        return module, 2
    if name in _NORMS:
        return module, 1
    return None


def _has_extra_state(module: str, own: int, spec: str, *, dense: bool,
                     te_final_norm: bool) -> bool:
    if own == 2:
        return True
    return spec == TE or (module == _FINAL_NORM and dense and te_final_norm)


def _dense(keys: Iterable[str]) -> bool:
    return not any(".mlp.router." in k or ".mlp.experts." in k for k in keys)


def extra_state_objects(tensors: Mapping[str, TensorMeta], spec: str) -> list[ObjectMeta]:
    """The ``_extra_state`` ShardedObjects a Megatron-Core GPT model of layer spec ``spec``
    saves beside ``tensors`` (its dist checkpoint keys, stacked or per layer), in key order."""
    if spec not in SPECS:
        raise ValueError(f"unknown layer spec {spec!r}")
    dense = _dense(tensors)
    out: list[ObjectMeta] = []
    for key in sorted(tensors):
        found = _module_of(key)
        if found is None or found[0] == _OUTPUT_LAYER:  # GPTModel drops the output layer's
            continue
        module, own = found
        if _has_extra_state(module, own, spec, dense=dense, te_final_norm=True):
            shape = tuple(tensors[key].shape)
            out.extend(_objects(f"{module}.{EXTRA_STATE}", shape[:max(0, len(shape) - own)]))
    return out


def _objects(key: str, lead: tuple[int, ...]) -> Iterable[ObjectMeta]:
    """One ShardedObject per position of the stacked axes ``lead`` (one if none)."""
    import itertools

    shape = lead or (1,)
    for offset in itertools.product(*(range(n) for n in shape)):
        yield ObjectMeta(key=key, unique_key=f"{key}/shard_{'.'.join(map(str, offset))}_"
                                             f"{'.'.join(map(str, shape))}",
                         global_shape=shape, global_offset=tuple(offset))


def legacy_extra_states(names: Iterable[str], spec: str) -> dict[str, str]:
    """``{module: payload kind}`` of the ``<module>._extra_state`` entries a Megatron-LM legacy
    file of a ``spec`` model holds beside its parameters ``names`` (the modules' own
    state-dict names; ``output_layer``'s included: only the sharded state dict drops it). A
    local-spec model's final norm is left out: it is a ``TENorm`` only where Transformer Engine
    is installed, and a strict ``load_state_dict`` refuses the entry elsewhere."""
    names = list(names)
    dense = _dense(names)
    out: dict[str, str] = {}
    for name in names:
        found = _module_of(name)
        if found is not None and _has_extra_state(*found, spec, dense=dense,
                                                  te_final_norm=False):
            out[found[0]] = payload_kind(spec, found[0])
    return out


def payload_kind(spec: str, module: str) -> str:
    """What the ``_extra_state`` of ``module`` (or of the object ``<module>._extra_state/…``)
    in a ``spec`` model holds without FP8 state: ``"none"`` (a Megatron-Core linear's ``None``;
    ``output_layer`` is one in both specs) or ``"empty_uint8"`` (Transformer Engine's empty
    ``uint8`` tensor: its linears and norms; a local-spec model's final norm is a ``TENorm``)."""
    module = module.split("/", 1)[0].removesuffix(f".{EXTRA_STATE}")
    if module == _OUTPUT_LAYER:
        return NONE
    if spec == TE or module.rsplit(".", 1)[-1] in _NORMS:
        return EMPTY_UINT8
    return NONE


def legacy_layer_spec(keys: Iterable[str], args: Any = None) -> str:
    """The layer spec of a Megatron-LM legacy checkpoint: its files hold the modules' own
    state-dict names, so a separate ``input_layernorm`` means the local spec (Transformer
    Engine fuses it into ``linear_qkv``); without one, ``args.transformer_impl`` decides
    (Megatron-LM's default: ``transformer_engine``)."""
    keys = list(keys)
    if any(_LAYER_NORM.search(k) for k in keys):
        return LOCAL
    if any(".linear_qkv.layer_norm_" in k for k in keys):
        return TE
    impl = args.get("transformer_impl") if isinstance(args, Mapping) else \
        getattr(args, "transformer_impl", None)
    return LOCAL if impl == "local" else TE
