"""GPT-OSS (``GptOssForCausalLM``) <-> Megatron-Core's GPT with attention sinks, biases,
alternating sliding windows and clamped-SwiGLU experts.

Names: transformers 5.25 ``models/gpt_oss/modeling_gpt_oss.py``; Megatron-Core 0.16.1
``transformer/dot_product_attention.py`` (``softmax_type="learnable"``: ``softmax_offset``),
``transformer/mlp.py`` (``activation_func_clamp_value``, ``glu_linear_offset``); the pairs of
Megatron-Bridge's ``src/megatron/bridge/models/gpt_oss/gpt_oss_bridge.py``.

* Attention: q/k/v (+ biases) <-> ``linear_qkv`` regrouped per query group, ``o_proj`` (+ bias)
  <-> ``linear_proj``, ``self_attn.sinks`` [heads] <-> ``core_attention.softmax_offset`` (both
  add one logit per head to the softmax and drop it). ``layer_types`` ``sliding_attention``
  <-> ``window_attn_skip_freq`` (a list: 1 = windowed); ``sliding_window`` W <->
  ``window_size`` ``(W - 1, 0)`` (transformers lets a query see W keys, Megatron-Core
  ``left + 1``). YaRN ``rope_parameters`` <-> ``position_embedding_type yarn`` and the
  ``yarn_*`` settings (``truncate`` = ``yarn_correction_range_round_to_int``).
* Experts, transformers' only layout: ``gate_up_proj`` [E, hidden, 2F] with gate and up
  INTERLEAVED along the last dimension (``gate_up[..., ::2]``, ``[..., 1::2]``), its bias
  [E, 2F] likewise; ``down_proj`` [E, F, hidden] (``x @ W``: transposed against a Linear).
  Megatron-Core's ``linear_fc1`` [E, 2F, hidden] is ``[gate; up]``, ``linear_fc2`` [E, hidden,
  F]: ``glu_interleaved`` (de-interleave, with ``t`` transpose the last two dimensions) and
  ``swap_last``. SwiGLU: ``(up + 1) * gate * sigmoid(1.702 gate)`` with gate clamped above and
  up clamped both sides at ``swiglu_limit`` = Megatron-Core's ``quick_gelu`` gated with
  ``glu_linear_offset 1`` and ``activation_func_clamp_value``.
* Router: ``mlp.router.weight``/``bias`` <-> ``mlp.router.weight``/``bias`` (Megatron-Core's
  router has a bias with ``add_bias_linear``); top-k of the logits then softmax over them =
  Megatron-Core's softmax router without ``moe_router_pre_softmax``.
* Every layer is MoE; imports write ``moe_layer_freq`` as a list (per-layer keys, as
  Megatron-Core saves a list); exports read per-layer keys.
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.planning.hf_families import Entry, Family

SA = "self_attention."
ATTENTION = (
    Entry(SA + "linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
    Entry(SA + "linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                     "self_attn.v_proj.weight"), "qkv"),
    Entry(SA + "linear_qkv.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                   "self_attn.v_proj.bias"), "qkv"),
    Entry(SA + "linear_proj.weight", ("self_attn.o_proj.weight",)),
    Entry(SA + "linear_proj.bias", ("self_attn.o_proj.bias",)),
    Entry(SA + "core_attention.softmax_offset", ("self_attn.sinks",)),
)
MOE = (
    Entry("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",),
          te="pre_mlp_layernorm.weight"),
    Entry("mlp.router.weight", ("mlp.router.weight",)),
    Entry("mlp.router.bias", ("mlp.router.bias",)),
)
EXPERTS_FUSED = (
    Entry("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.gate_up_proj",),
          "glu_interleaved_t"),
    Entry("mlp.experts.experts.linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",),
          "glu_interleaved"),
    Entry("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.down_proj",), "swap_last"),
    Entry("mlp.experts.experts.linear_fc2.bias", ("mlp.experts.down_proj_bias",)),
)
QUICK_GELU_ALPHA = 1.702  # megatron.core.fusions.fused_bias_geglu.quick_gelu


def _err(kind: str, msg: str, hint: str) -> Exception:
    from ckpt_tool import errors

    return getattr(errors, kind)(msg, hint=hint)


def features(config: dict[str, Any]) -> set[str]:
    return set()


def check_config(config: dict[str, Any]) -> None:
    bad = []
    if abs(float(config.get("swiglu_alpha", QUICK_GELU_ALPHA)) - QUICK_GELU_ALPHA) > 1e-9:
        bad.append(f"swiglu_alpha {config['swiglu_alpha']} (Megatron-Core's quick_gelu is "
                   "1.702)")
    if config.get("attention_bias") is False:
        bad.append("attention_bias: false")
    if bad:
        raise _err("UnsupportedError", "GptOss config.json has settings Megatron-Core "
                   "computes differently: " + "; ".join(bad), "use --to safetensors")


def _head_dim(config: dict[str, Any]) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"])
               // int(config["num_attention_heads"]))


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta") or rp.get("rope_theta") or 150000.0)
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind == "default":
        return {"position_embedding_type": "rope", "rotary_base": theta}
    if kind != "yarn" or rp.get("attention_factor") is not None:
        raise _err("UnsupportedError", f"GptOss rope {kind!r} (attention_factor "
                   f"{rp.get('attention_factor')}) has no Megatron-Core equivalent here",
                   "yarn without attention_factor, or default")
    return {"position_embedding_type": "yarn", "rotary_base": theta,
            "yarn_rotary_scaling_factor": float(rp.get("factor") or 1.0),
            "yarn_original_max_position_embeddings": int(
                rp.get("original_max_position_embeddings") or 4096),
            "yarn_beta_fast": float(rp.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(rp.get("beta_slow") or 1.0),
            "yarn_mscale": None, "yarn_mscale_all_dim": None,
            "yarn_correction_range_round_to_int": bool(rp.get("truncate", True))}


def args_from_config(config: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    check_config(config)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    types = list(config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else
                                               "full_attention" for i in range(layers)])
    window = config.get("sliding_window")
    windowed = [int(t == "sliding_attention") for t in types]
    ffn = int(config["intermediate_size"])
    return {
        "num_layers": layers, "hidden_size": int(config["hidden_size"]),
        "ffn_hidden_size": ffn, "num_attention_heads": heads,
        "group_query_attention": kv != heads, "num_query_groups": kv,
        "kv_channels": _head_dim(config), "qk_layernorm": False, "normalization": "RMSNorm",
        "norm_epsilon": float(config.get("rms_norm_eps") or 1e-5),
        "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(config.get("swiglu_limit") or 7.0),
        "add_bias_linear": True, "add_qkv_bias": True, "softmax_type": "learnable",
        "window_size": (int(window) - 1, 0) if window and any(windowed) else None,
        "window_attn_skip_freq": windowed if window and any(windowed) else None,
        "use_rotary_position_embeddings": True, "rotary_percent": 1.0, **_rope(config),
        "num_experts": int(config["num_local_experts"]), "moe_layer_freq": [1] * layers,
        "moe_ffn_hidden_size": ffn, "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef") or 0.0),
        "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
        "expert_tensor_parallel_size": 1, "mtp_num_layers": None,
    }


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    layers = int(args["num_layers"])
    heads = int(args["num_attention_heads"])
    bad = []
    if args.get("softmax_type") not in (None, "learnable"):
        bad.append(f"softmax_type {args['softmax_type']}")
    if args.get("moe_router_pre_softmax") or args.get("moe_router_score_function",
                                                      "softmax") != "softmax":
        bad.append("a router other than top-k then softmax")
    if args.get("moe_shared_expert_intermediate_size"):
        bad.append("shared experts")
    if bad:
        raise _err("UnsupportedError", "this checkpoint does not fit GptOssForCausalLM: "
                   + "; ".join(bad), "export with --to safetensors")
    ws, skip = args.get("window_size"), args.get("window_attn_skip_freq")
    if ws is None or int(ws[0]) < 0:
        windowed, window = [0] * layers, None
    else:
        window = int(ws[0]) + 1
        if isinstance(skip, (list, tuple)):
            windowed = [int(bool(x)) for x in skip]
        elif skip:
            windowed = [int((i + 1) % int(skip) != 0) for i in range(layers)]
        else:
            windowed = [1] * layers
    theta = float(args.get("rotary_base") or 10000.0)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if args.get("position_embedding_type") == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": theta,
                "factor": float(args.get("yarn_rotary_scaling_factor") or 1.0),
                "original_max_position_embeddings": int(
                    args.get("yarn_original_max_position_embeddings") or 4096),
                "beta_fast": float(args.get("yarn_beta_fast") or 32.0),
                "beta_slow": float(args.get("yarn_beta_slow") or 1.0),
                "truncate": bool(args.get("yarn_correction_range_round_to_int", True))}
    groups = int(args.get("num_query_groups") or heads) if args.get(
        "group_query_attention", True) else heads
    return {
        "hidden_size": int(args["hidden_size"]),
        "intermediate_size": int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(args.get("kv_channels") or int(args["hidden_size"]) // heads),
        "num_local_experts": int(args["num_experts"]),
        "num_experts_per_tok": int(args.get("moe_router_topk") or 2),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "sliding_window": window, "rope_parameters": rope, "attention_bias": True,
        "swiglu_alpha": QUICK_GELU_ALPHA,
        "swiglu_limit": float(args.get("activation_func_clamp_value") or 7.0),
        "rms_norm_eps": float(args.get("norm_epsilon") or 1e-5),
        "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0),
        "max_position_embeddings": int(args.get("max_position_embeddings")
                                       or args.get("seq_length") or 4096),
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv, hd = int(config.get("num_key_value_heads") or heads), _head_dim(config)
    e, f = int(config["num_local_experts"]), int(config["intermediate_size"])
    return {"self_attn.q_proj.weight": (heads * hd, hidden),
            "self_attn.k_proj.weight": (kv * hd, hidden),
            "self_attn.v_proj.weight": (kv * hd, hidden), "self_attn.sinks": (heads,),
            "self_attn.o_proj.weight": (hidden, heads * hd),
            "mlp.router.weight": (e, hidden),
            "mlp.experts.gate_up_proj": (e, hidden, 2 * f),
            "mlp.experts.down_proj": (e, f, hidden)}


def rope_params(config: dict[str, Any], op: str) -> tuple[tuple[str, int], ...]:
    return ()


FAMILY = Family(
    name="gpt_oss", architecture="GptOssForCausalLM", model_type="gpt_oss",
    attention=ATTENTION, dense=(), moe=MOE, experts=(), experts_fused=EXPERTS_FUSED,
    args_from_config=args_from_config, config_from_args=config_from_args, features=features,
    check_config=check_config, expected_shapes=expected_shapes, rope_params=rope_params,
    config_needs=("num_local_experts", "num_experts_per_tok", "intermediate_size"))
