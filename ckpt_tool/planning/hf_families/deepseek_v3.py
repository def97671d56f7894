"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi-K2 and Moonlight use the class) <->
Megatron-Core's Multi-Latent Attention GPT.

Names: Megatron-Core 0.16.1 ``megatron/core/transformer/multi_latent_attention.py`` and the MLA
layer specs of ``megatron/core/models/gpt/gpt_layer_specs.py``; transformers 5.25
``models/deepseek_v3/modeling_deepseek_v3.py``; the same pairs as Megatron-Bridge's
``src/megatron/bridge/models/deepseek/common.py`` (docs/commands.md cites them).

* MLA: ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without ``q_lora_rank``),
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj`` <->
  ``linear_q_down_proj`` / ``q_layernorm`` / ``linear_q_up_proj`` (``linear_q_proj``),
  ``linear_kv_down_proj`` / ``kv_layernorm`` / ``linear_kv_up_proj``, ``linear_proj``. The
  Transformer-Engine spec fuses the two latent norms into the up projections
  (``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``) and keeps
  ``input_layernorm`` a ``TENorm``. Row orders agree: both split each head's query rows as
  ``[nope | rope]`` and ``kv_a_proj_with_mqa``'s as ``[kv_lora | rope]``, and ``kv_b_proj``'s
  per head as ``[k_nope | v]``. The rotary rows: Megatron-Core's MLA RoPE
  (``_apply_rotary_pos_emb_bshd(..., multi_latent_attention=True)``) reads them as interleaved
  pairs ``(x0, x1), (x2, x3), ...`` (``t[..., 0::2]``, ``t[..., 1::2]``), which is transformers'
  ``apply_rotary_pos_emb_interleave`` (``rope_interleave: true``, DeepSeek's releases): copied
  as they are. A config with ``rope_interleave: false`` rotates halves (``rotate_half``): its
  rotary rows ``[x0 .. x_{d/2-1} | x_{d/2} ..]`` are interleaved on import (Megatron row ``2j``
  = HF row ``j``, ``2j+1`` = HF row ``d/2 + j``); exports write ``rope_interleave: true``.
* MLP: the first ``first_k_dense_replace`` layers dense (``moe_layer_freq`` ``[0]*k + [1]*...``),
  the others MoE: ``mlp.gate`` (fp32 in transformers) <-> ``mlp.router``, its
  ``e_score_correction_bias`` <-> ``mlp.router.expert_bias`` (a persistent fp32 buffer),
  ``n_shared_experts`` x ``moe_intermediate_size`` shared experts without a gate.
* Router: sigmoid scores, top-k chosen on score + bias, within ``topk_group`` of ``n_group``
  groups, weights renormalised and scaled by ``routed_scaling_factor``. transformers ranks a
  group by its top-2 scores, Megatron-Core by its top ``topk / group_topk``: equal when that is
  2 (DeepSeek-V3: 8 / 4) or every group is chosen; Megatron-Core's sigmoid router always
  renormalises (``norm_topk_prob: true``). Other settings are refused, never changed silently.
* MTP: HF keeps layer ``j`` after the last as ``model.layers.{num_hidden_layers + j}.`` (a full
  decoder layer + ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of the
  embedding and output layer: ``embed_tokens``, ``shared_head.head``) <-> ``mtp.layers.{j}.``
  (``transformer_layer.*``, ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``; the
  embedding and output layer are the model's). ``eh_proj`` is used as stored: Megatron-Core
  concatenates ``[enorm(embedding); hnorm(hidden)]``, as vLLM's ``deepseek_mtp`` does with HF's.
"""

from __future__ import annotations

from typing import Any

from ckpt_tool.planning.hf_families import Entry, Family

SA = "self_attention."
ATTENTION = (
    Entry("input_layernorm.weight", ("input_layernorm.weight",)),
    Entry(SA + "linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",), when="q_lora"),
    Entry(SA + "q_layernorm.weight", ("self_attn.q_a_layernorm.weight",),
          te=SA + "linear_q_up_proj.layer_norm_weight", when="q_lora"),
    Entry(SA + "linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",), "rope_q",
          when="q_lora"),
    Entry(SA + "linear_q_proj.weight", ("self_attn.q_proj.weight",), "rope_q", when="q_full"),
    Entry(SA + "linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",),
          "rope_kv"),
    Entry(SA + "kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",),
          te=SA + "linear_kv_up_proj.layer_norm_weight"),
    Entry(SA + "linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",)),
    Entry(SA + "linear_proj.weight", ("self_attn.o_proj.weight",)),
)
DENSE = (
    Entry("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",),
          te="mlp.linear_fc1.layer_norm_weight"),
    Entry("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    Entry("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)
MOE = (
    Entry("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",)),
    Entry("mlp.router.weight", ("mlp.gate.weight",)),
    Entry("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",), when="expert_bias"),
    Entry("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight",
                                                   "mlp.shared_experts.up_proj.weight"), "glu",
          when="shared"),
    Entry("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_experts.down_proj.weight",),
          when="shared"),
)
EXPERTS = (
    Entry("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight",
                                                    "mlp.experts.{e}.up_proj.weight"), "glu"),
    Entry("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",)),
)
# transformers 5's own layout (save_pretrained(save_original_format=False)): gate_up_proj
# [experts, 2 x moe_ffn, hidden] = per expert [gate; up], down_proj [experts, hidden, moe_ffn]
EXPERTS_FUSED = (
    Entry("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.gate_up_proj",)),
    Entry("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.down_proj",)),
)
MTP = (
    Entry("enorm.weight", ("enorm.weight",)),
    Entry("hnorm.weight", ("hnorm.weight",)),
    Entry("eh_proj.weight", ("eh_proj.weight",)),
    Entry("final_layernorm.weight", ("shared_head.norm.weight",)),
)
MTP_SHARED = (("embed_tokens.weight", "embedding.word_embeddings.weight"),
              ("shared_head.head.weight", "output_layer.weight"))


def _err(kind: str, msg: str, hint: str) -> Exception:
    from ckpt_tool import errors

    return getattr(errors, kind)(msg, hint=hint)


def features(config: dict[str, Any]) -> set[str]:
    out = {"q_lora" if config.get("q_lora_rank") else "q_full", "expert_bias"}
    if int(config.get("n_shared_experts") or 0):
        out.add("shared")
    return out


def check_config(config: dict[str, Any]) -> None:
    """UnsupportedError for DeepSeek-V3 settings Megatron-Core's MLA GPT computes otherwise."""
    topk, groups = int(config["num_experts_per_tok"]), int(config.get("n_group") or 1)
    topk_group = int(config.get("topk_group") or groups)
    bad = []
    if config.get("attention_bias"):
        bad.append("attention_bias: true (Megatron-Core's MLA linears have no bias here)")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        bad.append(f"scoring_func {config['scoring_func']!r} (the rule is DeepSeek-V3's "
                   "sigmoid router)")
    if topk > 1 and config.get("norm_topk_prob") is False:
        bad.append("norm_topk_prob: false (Megatron-Core's sigmoid router renormalises)")
    if groups > 1 and topk_group < groups and topk // topk_group != 2:
        bad.append(f"num_experts_per_tok {topk} / topk_group {topk_group} != 2 (transformers "
                   "ranks groups by their top-2 scores, Megatron-Core by its top "
                   f"{topk // topk_group})")
    if config.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act {config['hidden_act']!r}")
    if bad:
        raise _err("UnsupportedError", "DeepseekV3 config.json has settings Megatron-Core "
                   "computes differently: " + "; ".join(bad),
                   "convert a checkpoint with DeepSeek-V3's settings, or use --to safetensors")


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta") or rp.get("rope_theta") or 10000.0)
    out: dict[str, Any] = {"rotary_base": theta, "rope_type": "rope",
                           "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    kind = rp.get("rope_type") or rp.get("type") or "default"
    if kind == "yarn":
        out.update(rope_type="yarn", rotary_scaling_factor=float(rp.get("factor") or 1.0),
                   mscale=float(rp.get("mscale") or 1.0),
                   mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
                   beta_fast=float(rp.get("beta_fast") or 32.0),
                   beta_slow=float(rp.get("beta_slow") or 1.0),
                   original_max_position_embeddings=int(
                       rp.get("original_max_position_embeddings") or 4096))
    elif kind != "default":
        raise _err("UnsupportedError", f"DeepseekV3 rope type {kind!r} has no Megatron-Core "
                   "MLA equivalent", "rope (default) or yarn")
    return out


def args_from_config(config: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    """Megatron-LM arguments (their real names) of a DeepseekV3 config.json; the parallel
    layout, vocab and dtype are added by the caller."""
    check_config(config)
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    dense = min(int(config.get("first_k_dense_replace") or 0), layers)
    moe_ffn = int(config["moe_intermediate_size"])
    shared = int(config.get("n_shared_experts") or 0) * moe_ffn
    groups = int(config.get("n_group") or 1)
    q_lora = config.get("q_lora_rank")
    return {
        "num_layers": layers, "hidden_size": int(config["hidden_size"]),
        "ffn_hidden_size": int(config["intermediate_size"]), "num_attention_heads": heads,
        "group_query_attention": False, "num_query_groups": heads,
        "kv_channels": int(config["v_head_dim"]),
        "multi_latent_attention": True, "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": int(config["kv_lora_rank"]),
        "qk_head_dim": int(config["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(config["qk_rope_head_dim"]),
        "v_head_dim": int(config["v_head_dim"]), "qk_layernorm": True,
        "normalization": "RMSNorm", "norm_epsilon": float(config.get("rms_norm_eps") or 1e-6),
        "swiglu": True, "add_bias_linear": False, "add_qkv_bias": False,
        "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
        "rotary_percent": 1.0, **_rope(config),
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
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False, "moe_token_dispatcher_type": "alltoall",
        "expert_tensor_parallel_size": 1,
        "mtp_num_layers": mtp_layers or None,
    }


def moe_config_from_args(args: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The MoE, norm and length fields of a DeepSeek-V3-style config.json (dense layers
    first, sigmoid router, ungated shared experts) for Megatron-LM ``args``; UnsupportedError
    naming ``architecture`` where the checkpoint computes otherwise."""
    layers = int(args["num_layers"])
    freq = args.get("moe_layer_freq", 1)
    kinds = list(freq) if isinstance(freq, (list, tuple)) else [
        int(i % int(freq) == 0) for i in range(layers)]
    dense = next((i for i, k in enumerate(kinds) if k), layers)
    bad = []
    if kinds != [0] * dense + [1] * (layers - dense):
        bad.append(f"moe_layer_freq {freq} (dense layers first, then MoE)")
    if args.get("moe_router_score_function", "softmax") != "sigmoid":
        bad.append(f"router score function {args.get('moe_router_score_function', 'softmax')}"
                   " (the router is sigmoid)")
    if args.get("moe_shared_expert_gate"):
        bad.append("a gated shared expert (the shared experts have no gate)")
    moe_ffn = int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
    shared = int(args.get("moe_shared_expert_intermediate_size") or 0)
    if shared % moe_ffn:
        bad.append(f"shared expert size {shared}, not a multiple of moe_ffn_hidden_size "
                   f"{moe_ffn}")
    topk = int(args.get("moe_router_topk") or 2)
    groups = int(args.get("moe_router_num_groups") or 1)
    gtopk = int(args.get("moe_router_group_topk") or groups)
    if groups > 1 and gtopk < groups and topk // gtopk != 2:
        bad.append(f"moe_router_topk {topk} / moe_router_group_topk {gtopk} != 2 (transformers "
                   "ranks groups by their top-2 scores)")
    if bad:
        raise _err("UnsupportedError", f"this checkpoint does not fit {architecture}: "
                   + "; ".join(bad), "export with --to safetensors")
    return {
        "hidden_size": int(args["hidden_size"]), "intermediate_size": int(args["ffn_hidden_size"]),
        "moe_intermediate_size": moe_ffn, "num_hidden_layers": layers,
        "num_attention_heads": int(args["num_attention_heads"]),
        "n_routed_experts": int(args["num_experts"]), "num_experts_per_tok": topk,
        "n_shared_experts": shared // moe_ffn, "first_k_dense_replace": dense,
        "n_group": groups, "topk_group": gtopk, "norm_topk_prob": True,
        "routed_scaling_factor": float(args.get("moe_router_topk_scaling_factor") or 1.0),
        "num_nextn_predict_layers": int(args.get("mtp_num_layers") or 0),
        "rms_norm_eps": float(args.get("norm_epsilon") or 1e-6), "hidden_act": "silu",
        "max_position_embeddings": int(args.get("max_position_embeddings")
                                       or args.get("seq_length") or 4096),
    }


def config_from_args(args: dict[str, Any]) -> dict[str, Any]:
    """DeepseekV3 config.json fields for Megatron-LM ``args`` (UnsupportedError where the
    checkpoint computes what DeepSeek-V3 cannot)."""
    moe = moe_config_from_args(args, "DeepseekV3ForCausalLM")
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(args.get("rotary_base") or 10000.0)}
    if args.get("rope_type") == "yarn":
        rope.update(rope_type="yarn", factor=float(args.get("rotary_scaling_factor") or 1.0),
                    mscale=float(args.get("mscale") or 1.0),
                    mscale_all_dim=float(args.get("mscale_all_dim") or 0.0),
                    beta_fast=float(args.get("beta_fast") or 32.0),
                    beta_slow=float(args.get("beta_slow") or 1.0),
                    original_max_position_embeddings=int(
                        args.get("original_max_position_embeddings") or 4096))
    heads = int(args["num_attention_heads"])
    return {
        **moe, "num_key_value_heads": heads,
        "q_lora_rank": args.get("q_lora_rank"), "kv_lora_rank": int(args["kv_lora_rank"]),
        "qk_nope_head_dim": int(args["qk_head_dim"]),
        "qk_rope_head_dim": int(args["qk_pos_emb_head_dim"]),
        "v_head_dim": int(args["v_head_dim"]), "rope_interleave": True,
        "rope_parameters": rope, "rope_theta": rope["rope_theta"],
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "attention_bias": False,
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF layer tensors' shapes (leaf -> shape) that config.json implies: the weights must
    agree (a q_lora_rank that is not q_a_proj's row count is a contradiction)."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    v, kv_lora = int(config["v_head_dim"]), int(config["kv_lora_rank"])
    q = heads * (nope + rope)
    out = {"self_attn.kv_a_proj_with_mqa.weight": (kv_lora + rope, hidden),
           "self_attn.kv_a_layernorm.weight": (kv_lora,),
           "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_lora),
           "self_attn.o_proj.weight": (hidden, heads * v),
           "input_layernorm.weight": (hidden,)}
    q_lora = config.get("q_lora_rank")
    if q_lora:
        out.update({"self_attn.q_a_proj.weight": (int(q_lora), hidden),
                    "self_attn.q_a_layernorm.weight": (int(q_lora),),
                    "self_attn.q_b_proj.weight": (q, int(q_lora))})
    else:
        out["self_attn.q_proj.weight"] = (q, hidden)
    return out


def rope_params(config: dict[str, Any], op: str) -> tuple[tuple[str, int], ...]:
    """The ``rope_rows`` parameters of a ``rope_q``/``rope_kv`` entry: ``blocks`` of ``keep``
    rows then ``rot`` rotary rows; ``()`` when the HF rows are already interleaved."""
    if config.get("rope_interleave", True):
        return ()
    rot = int(config["qk_rope_head_dim"])
    if op == "rope_q":
        return (("blocks", int(config["num_attention_heads"])),
                ("keep", int(config["qk_nope_head_dim"])), ("rot", rot))
    return (("blocks", 1), ("keep", int(config["kv_lora_rank"])), ("rot", rot))


FAMILY = Family(
    name="deepseek_v3", architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
    attention=ATTENTION, dense=DENSE, moe=MOE, experts=EXPERTS, experts_fused=EXPERTS_FUSED,
    mtp=MTP, mtp_shared=MTP_SHARED, args_from_config=args_from_config,
    config_from_args=config_from_args, features=features, check_config=check_config,
    expected_shapes=expected_shapes, rope_params=rope_params)
