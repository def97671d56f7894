"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``) <-> Megatron-Core's GPT with grouped-query
attention, dense-then-MoE layers and MTP.

Names: transformers 5.25 ``models/glm4_moe/modeling_glm4_moe.py``; Megatron-Core 0.16.1
``megatron/core/models/gpt/gpt_layer_specs.py`` (``get_gpt_decoder_block_spec``); the same pairs
as Megatron-Bridge's ``src/megatron/bridge/models/glm/glm45_bridge.py`` (docs/commands.md cites
them).

* Attention: ``q_proj``/``k_proj``/``v_proj`` (with ``attention_bias``: their biases; ``o_proj``
  has none) <-> ``linear_qkv`` (rows per query group ``[q heads; k; v]``: the ``qkv`` transform,
  ``add_qkv_bias``), ``o_proj`` <-> ``linear_proj``; ``use_qk_norm``: ``q_norm``/``k_norm``
  (per head, before RoPE) <-> ``q_layernorm``/``k_layernorm`` (``qk_layernorm``, applied there
  too). Partial rotary: transformers rotates the first ``head_dim x partial_rotary_factor``
  dimensions of each head in halves (``rotate_half``; default factor 0.5), Megatron-Core's
  ``RotaryEmbedding`` with ``rotary_percent`` the same first dimensions the same way
  (``rotary_interleaved`` off): ``rotary_percent = partial_rotary_factor``.
* Norms: Megatron-Core's local GPT layer spec saves ``input_layernorm`` and
  ``pre_mlp_layernorm`` under the Transformer-Engine names (its ``sharded_state_dict_keys_map``:
  ``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), in
  MoE layers too; the TE spec keeps an MoE layer's ``pre_mlp_layernorm.weight`` (a ``TENorm``).
* MLP, router, shared experts, routed experts (both transformers 5 layouts) and the MTP layer:
  DeepSeek-V3's tables (:mod:`ckpt_tool.planning.hf_families.deepseek_v3`): ``first_k_dense_replace``
  dense layers, a sigmoid router (fp32 ``gate.weight``) whose ``e_score_correction_bias`` is
  Megatron-Core's ``mlp.router.expert_bias``, ``n_group``/``topk_group`` group routing with the
  same top-2 condition, ``routed_scaling_factor``, ``norm_topk_prob: true`` only. transformers
  ignores the MTP layer on load (``_keys_to_ignore_on_load_unexpected``); GLM's releases hold it
  as ``model.layers.{num_hidden_layers}.*`` as DeepSeek's do, and so do exports.
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.planning.hf_families import Entry, Family
from ckpt_tool.planning.hf_families import deepseek_v3 as ds

SA = "self_attention."
ATTENTION = (
    Entry(SA + "linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    Entry(SA + "linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight"), "qkv"),
    Entry(SA + "linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                   "self_attn.v_proj.bias"), "qkv", when="qkv_bias"),
    Entry(SA + "q_layernorm.weight", ("self_attn.q_norm.weight",), when="qk_norm"),
    Entry(SA + "k_layernorm.weight", ("self_attn.k_norm.weight",), when="qk_norm"),
    Entry(SA + "linear_proj.weight", ("self_attn.o_proj.weight",)),
)

# the MLP norms as both specs save them (see the module docstring)
DENSE = (Entry("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",)),
         *ds.DENSE[1:])
MOE = (Entry("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",),
             te="pre_mlp_layernorm.weight"), *ds.MOE[1:])


def _err(kind: str, msg: str, hint: str) -> Exception:
    from ckpt_tool import errors

    return getattr(errors, kind)(msg, hint=hint)


def features(config: dict[str, Any]) -> set[str]:
    out = {"expert_bias"}
    if config.get("attention_bias"):
        out.add("qkv_bias")
    if config.get("use_qk_norm"):
        out.add("qk_norm")
    if int(config.get("n_shared_experts") or 0):
        out.add("shared")
    return out


def _rope(config: dict[str, Any]) -> tuple[float, float]:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind != "default":
        raise _err("UnsupportedError", f"Glm4Moe rope type {kind!r}: the rule is GLM's plain "
                   "RoPE", "rope_type default")
    theta = float(config.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    factor = rp.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    return theta, float(factor)


def check_config(config: dict[str, Any]) -> None:
    """UnsupportedError for settings Megatron-Core computes otherwise (DeepSeek-V3's router
    rules; ``hidden_act`` silu)."""
    topk, groups = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1)
    topk_group = int(config.get("topk_group") or groups)
    bad = []
    if topk > 1 and config.get("norm_topk_prob") is False:
        bad.append("norm_topk_prob: false (Megatron-Core's sigmoid router renormalises)")
    if groups > 1 and topk_group < groups and topk // topk_group != 2:
        bad.append(f"num_experts_per_tok {topk} / topk_group {topk_group} != 2 (transformers "
                   "ranks groups by their top-2 scores, Megatron-Core by its top "
                   f"{topk // topk_group})")
    if config.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {config['hidden_act']!r}")
    if bad:
        raise _err("UnsupportedError", "Glm4Moe config.json has settings Megatron-Core "
                   "computes differently: " + "; ".join(bad),
                   "convert a checkpoint with GLM-4.5's settings, or use --to safetensors")


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"])
               // int(config["num_attention_heads"]))


def args_from_config(config: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    """Megatron-LM arguments (their real names) of a Glm4Moe config.json; the parallel layout,
    vocab and dtype are added by the caller."""
    check_config(config)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    groups_kv = int(config.get("num_key_value_heads") or heads)
    dense = min(int(config.get("first_k_dense_replace") or 0), layers)
    moe_ffn = int(config["moe_intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0) * moe_ffn
    groups = int(config.get("n_group") or 1)
    theta, partial = _rope(config)
    return {
        "num_layers": layers, "hidden_size": int(config["hidden_size"]),
        "ffn_hidden_size": int(config["intermediate_size"]), "num_attention_heads": heads,
        "group_query_attention": groups_kv != heads, "num_query_groups": groups_kv,
        "kv_channels": _head_dim(config), "qk_layernorm": bool(config.get("use_qk_norm")),
        "normalization": "RMSNorm", "norm_epsilon": float(config.get("rms_norm_eps") or 1e-5),
        "swiglu": True, "add_bias_linear": False,
        "add_qkv_bias": bool(config.get("attention_bias")),
        "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
        "rotary_base": theta, "rotary_percent": partial, "rotary_interleaved": False,
        "num_experts": int(config["n_routed_experts"]),
        "moe_layer_freq": [0] * dense + [1] * (layers - dense),
        "moe_ffn_hidden_size": moe_ffn,
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": False, "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_pre_softmax": False,
        "moe_router_num_groups": groups if groups > 1 else None,
        "moe_router_group_topk": int(config.get("topk_group") or 1) if groups > 1 else None,
        "moe_router_topk_scaling_factor": float(config.get("routed_scaling_factor") or 1.0),
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
        "expert_tensor_parallel_size": 1,
        "mtp_num_layers": mtp_layers or None,
    }


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    """Glm4Moe config.json fields for Megatron-LM ``args`` (UnsupportedError where the
    checkpoint computes what GLM-4.5 cannot)."""
    moe = ds.moe_config_from_args(args, "Glm4MoeForCausalLM")
    bad = []
    if args.get("add_bias_linear"):
        bad.append("biases on every linear (GLM-4.5 has them on q/k/v only)")
    if args.get("rotary_interleaved"):
        bad.append("interleaved rotary dimensions")
    if args.get("rope_type") == "yarn" or args.get("position_embedding_type") not in (
            None, "rope"):
        bad.append(f"position embedding {args.get('position_embedding_type')} "
                   f"{args.get('rope_type') or ''}".rstrip())
    if bad:
        raise _err("UnsupportedError", "this checkpoint does not fit Glm4MoeForCausalLM: "
                   + "; ".join(bad), "export with --to safetensors")
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_query_groups") or heads) if args.get(
        "group_query_attention", True) else heads
    theta = float(args.get("rotary_base") or 10000.0)
    return {**moe, "num_key_value_heads": groups,
            "head_dim": int(args.get("kv_channels") or int(args["hidden_size"]) // heads),
            "attention_bias": bool(args.get("add_qkv_bias")),
            "use_qk_norm": bool(args.get("qk_layernorm")),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor": float(args.get("rotary_percent")
                                                               or 1.0)}}


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF layer tensors' shapes that config.json implies (a ``head_dim`` or head count that
    is not the projections' is a contradiction)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv, hd = int(config.get("num_key_value_heads") or heads), _head_dim(config)
    return {"self_attn.q_proj.weight": (heads * hd, hidden),
            "self_attn.k_proj.weight": (kv * hd, hidden),
            "self_attn.v_proj.weight": (kv * hd, hidden),
            "self_attn.q_proj.bias": (heads * hd,), "self_attn.k_proj.bias": (kv * hd,),
            "self_attn.v_proj.bias": (kv * hd,), "self_attn.q_norm.weight": (hd,),
            "self_attn.k_norm.weight": (hd,), "self_attn.o_proj.weight": (hidden, heads * hd),
            "input_layernorm.weight": (hidden,)}


def rope_params(config: dict[str, Any], op: str) -> tuple[tuple[str, int], ...]:
    return ()


FAMILY = Family(
    name="glm4_moe", architecture="Glm4MoeForCausalLM", model_type="glm4_moe",
    attention=ATTENTION, dense=DENSE, moe=MOE, experts=ds.EXPERTS,
    experts_fused=ds.EXPERTS_FUSED, mtp=ds.MTP, mtp_shared=ds.MTP_SHARED,
    args_from_config=args_from_config, config_from_args=config_from_args, features=features,
    check_config=check_config, expected_shapes=expected_shapes, rope_params=rope_params)
