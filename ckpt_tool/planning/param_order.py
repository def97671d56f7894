"""The order in which Megatron-Core's GPTModel registers its parameters, as data, in saved (dist)
key names (pure; no I/O). DDP lays its gradient buffers out in the reverse of this order
(:mod:`ckpt_tool.planning.optim_buckets`), so the order decides where each parameter's
optimizer state lies in a ``dp_reshardable`` checkpoint.

Keys are Megatron-Core's GPTModel names as Megatron-LM and Megatron-Bridge save them (the
unwrapped model's ``sharded_state_dict``). NeMo 2 saves the wrapped model chunk's
(``DDP(Float16Module(GPTModel))``: Megatron-Core's default ``sharded_state_dict`` names the
child, so every key starts with ``module.``): :func:`model_key_prefix` finds that prefix and
:func:`stage_params` takes it.

Dense layers: the local spec registers ``input_layernorm`` (saved as
``linear_qkv.layer_norm_*``) before ``linear_proj``; Transformer-Engine layers fuse it into
``linear_qkv``, after ``linear_proj``.

MoE layers (:data:`MOE_MLP_ORDER`): after the attention part, the pre-MLP norm, then
``MoELayer``'s modules as its ``__init__`` creates them: the router, the routed experts
(``SequentialMLP``: local expert 0's ``linear_fc1``/``linear_fc2``, then expert 1's, ...; saved
stacked over global experts under ``mlp.experts.experts.``), the shared experts (``linear_fc1``,
``linear_fc2``, then the optional ``gate_weight``). Routed experts are expert-parallel
(``allreduce=False``, a buffer of their own) only when ``expert_model_parallel_size > 1``;
otherwise they sit in the dense buffer in this order.
"""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["NOT_PARAMETERS", "COMPONENTS", "GPT_PARAMETER_ORDER", "MOE_MLP_ORDER", "LAYER_PREFIX", "StageParam", "stage_params",
           "moe_expert_keys", "model_key_prefix", "TIED_KEYS"]

LAYER_PREFIX = "decoder.layers."
_ATTN_NORM = ["self_attention.linear_qkv.layer_norm_weight",
              "self_attention.linear_qkv.layer_norm_bias"]
_ATTN = ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
         "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias"]
_PROJ = ["self_attention.linear_proj.weight", "self_attention.linear_proj.bias"]
_MLP = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
_ENDS = {"first": ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"],
         "last": ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                  "output_layer.weight"]}
#: Parameter registration order of Megatron-Core's GPTModel, in saved (dist) key names:
#: ``first`` on the first pipeline stage, ``attention`` + ``mlp`` per dense transformer layer
#: (suffixes of ``decoder.layers.``; ``layer`` is their concatenation), ``last`` on the last
#: stage.
GPT_PARAMETER_ORDER: dict[str, dict[str, list[str]]] = {
    "local": {**_ENDS, "attention": _ATTN_NORM + _PROJ + _ATTN, "mlp": _MLP,
              "layer": _ATTN_NORM + _PROJ + _ATTN + _MLP},
    "transformer_engine": {**_ENDS, "attention": _PROJ + _ATTN_NORM + _ATTN, "mlp": _MLP,
                           "layer": _PROJ + _ATTN_NORM + _ATTN + _MLP},
}
#: The MLP part of a MoE layer (suffixes of ``decoder.layers.``): ``norm`` (the pre-MLP norm,
#: under either name), ``router``, ``experts`` (``SequentialMLP``: the stacked key prefix, then
#: the suffixes registered per local expert), ``shared`` (shared experts).
MOE_MLP_ORDER: dict[str, list[str]] = {
    "norm": ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
             "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias"],
    "router": ["mlp.router.weight", "mlp.router.bias"],
    "experts_prefix": ["mlp.experts.experts."],
    "experts": ["linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"],
    "shared": ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.bias",
               "mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.linear_fc2.bias",
               "mlp.shared_experts.gate_weight"],
}

#: Saved model tensors that are not parameters (no optimizer state): Transformer Engine's extra
#: state, the router's expert bias (a persistent fp32 buffer that aux-loss-free balancing
#: updates outside the optimizer).
NOT_PARAMETERS = (r"_extra_state$", r"(^|\.)router\.expert_bias$")

#: Parameters Megatron-Core stores per component (``<name>.<component>`` keys), each component
#: split by tensor parallelism on its own: a rank's parameter is its part of each component,
#: concatenated along dim 0 in this order (Mamba's ``in_proj`` = [z; x; B; C; dt], ``conv1d`` =
#: [x; B; C]: ``MambaMixer`` of megatron-core 0.16).
COMPONENTS: dict[str, tuple[str, ...]] = {
    r"mixer\.in_proj\.weight": ("z", "x", "B", "C", "dt"),
    r"mixer\.conv1d\.weight": ("x", "B", "C"),
    r"mixer\.conv1d\.bias": ("x", "B", "C"),
}

_EMBEDDING, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
#: The parameters DDP treats as the shared embedding when the embeddings are tied.
TIED_KEYS = (_EMBEDDING, _OUTPUT)
_ROOTS = ("embedding.", "decoder.", "output_layer.")
_WRAPPER = "module."

#: ``(key, global layer or None, global expert or None)``
StageParam = tuple[str, "int | None", "int | None"]


def model_key_prefix(keys: Mapping[str, object] | Sequence[str]) -> str:
    """What stands before the GPTModel names in ``keys`` (the checkpoint's model keys): ``""``
    (the unwrapped model), ``"module."`` (NeMo 2: the DDP-wrapped chunk), ``"module.module."``
    ...; ``""`` when the keys do not agree on one."""
    found = set()
    for key in keys:
        prefix = ""
        while key.startswith(prefix + _WRAPPER):
            prefix += _WRAPPER
        if key[len(prefix):].startswith(_ROOTS):
            found.add(prefix)
    return found.pop() if len(found) == 1 else ""


def moe_expert_keys(prefix: str = "") -> list[str]:
    """The stacked routed-expert keys (full names, after ``prefix``) the order knows."""
    stacked = prefix + LAYER_PREFIX + MOE_MLP_ORDER["experts_prefix"][0]
    return [stacked + s for s in MOE_MLP_ORDER["experts"]]


def stage_params(keys: Mapping[str, object] | Sequence[str], spec: str, layers: Sequence[int],
                 first: bool, last: bool, experts: Sequence[int] = (),
                 prefix: str = "") -> list[StageParam]:
    """One pipeline stage's (or model chunk's) parameters in registration order, restricted to
    ``keys`` (the checkpoint's model keys, each GPTModel name after ``prefix``:
    :func:`model_key_prefix`). ``experts``: the global routed experts this rank holds, in
    local order (empty for a dense model)."""
    present = {k[len(prefix):] for k in keys if k.startswith(prefix)}
    return [(prefix + k, layer, expert)
            for k, layer, expert in _stage_params(present, spec, layers, first, last, experts)]


def _stage_params(present: set[str], spec: str, layers: Sequence[int], first: bool,
                  last: bool, experts: Sequence[int]) -> list[StageParam]:
    order = GPT_PARAMETER_ORDER[spec]
    moe = any(k in present for k in moe_expert_keys())
    out: list[StageParam] = []
    if first:
        out += [(k, None, None) for k in order["first"] if k in present]
    for layer in layers:
        out += [(LAYER_PREFIX + s, layer, None) for s in order["attention"]
                if LAYER_PREFIX + s in present]
        if not moe:
            out += [(LAYER_PREFIX + s, layer, None) for s in order["mlp"]
                    if LAYER_PREFIX + s in present]
            continue
        out += [(LAYER_PREFIX + s, layer, None)
                for s in MOE_MLP_ORDER["norm"] + MOE_MLP_ORDER["router"]
                if LAYER_PREFIX + s in present]
        for expert in experts:
            out += [(k, layer, expert) for k in moe_expert_keys() if k in present]
        out += [(LAYER_PREFIX + s, layer, None) for s in MOE_MLP_ORDER["shared"]
                if LAYER_PREFIX + s in present]
    if last:
        out += [(k, None, None) for k in order["last"] if k in present]
        if not first and _EMBEDDING in present and _OUTPUT not in present:
            # tied embeddings (no output_layer.weight saved): a last stage that is not the
            # first registers its own copy of the embedding as its output layer's weight
            out.append((_EMBEDDING, None, None))
    return out
