"""Hugging Face transformers architectures as data: the name maps between a Megatron-Core GPT
checkpoint and an HF model directory, and how config.json maps to Megatron-LM ``args``.

Pure data and pure functions (no I/O, no torch). :mod:`ckpt_tool.planning.hf_plan` turns a rule
into per-tensor recipes. Each rule lists, per decoder layer, how HF tensors (names below the
layer prefix ``model.layers.{i}.``) map to Megatron-Core tensors (names below
``decoder.layers.{i}.``), with one of these transforms:

* ``copy``: same tensor;
* ``qkv``: HF ``q``/``k``/``v`` projections <-> Megatron-Core ``linear_qkv``, whose rows are
  grouped per query group: ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]``;
* ``glu``: HF ``gate``/``up`` projections <-> ``linear_fc1`` = ``[gate; up]`` (SwiGLU);
* ``norm``: a layer norm whose Megatron-Core name depends on the layer spec (TE fuses the
  norm into the next linear: ``linear_qkv.layer_norm_weight``; the local spec keeps
  ``input_layernorm.weight``).

The embedding and output layer are ``vocab`` tensors: Megatron pads their rows to
``padded_vocab_size``; export drops the padded rows, import pads them with zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckpt_tool.planning.hf_extras import WINDOW_ARCHS, sliding_window_of, window_from_hf
from ckpt_tool.planning.hf_families import Family
from ckpt_tool.planning.hf_families.deepseek_v3 import FAMILY as DEEPSEEK_V3
from ckpt_tool.planning.hf_families.glm4_moe import FAMILY as GLM4_MOE
from ckpt_tool.planning.hf_families.gpt_oss import FAMILY as GPT_OSS

__all__ = ["ArchRule", "LayerMap", "ARCHS", "FAMILIES", "rule_for_config", "rule_named", "guess_arch",
           "args_from_hf_config", "hf_config_from_args", "padded_vocab", "TE_NORMS",
           "GPT2_CONFIG_NAMES"]

# Norm names: (local spec name, TE spec name), both below ``decoder.layers.{i}.``.
TE_NORMS = {
    "input_layernorm": ("input_layernorm", "self_attention.linear_qkv.layer_norm"),
    "pre_mlp_layernorm": ("pre_mlp_layernorm", "mlp.linear_fc1.layer_norm"),
}


@dataclass(frozen=True)
class LayerMap:
    """One Megatron-Core tensor of a decoder layer and the HF tensor(s) it comes from."""

    mcore: str
    hf: tuple[str, ...]
    transform: str = "copy"  # copy | qkv | glu | norm
    when: str = ""  # a config feature the tensor exists under (see ``features_of_config``)
    expert: bool = False  # one per routed expert: HF names hold ``{e}``
    fused: str = ""  # the experts as one HF ``[experts, ...]`` tensor (transformers 5's layout)


@dataclass(frozen=True)
class ArchRule:
    """One HF architecture: its names, its layer map and its Megatron-LM settings."""

    name: str
    architecture: str
    model_type: str
    layers: tuple[LayerMap, ...]
    normalization: str = "RMSNorm"
    position: str = "rope"
    embed: str = "model.embed_tokens.weight"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head.weight"
    layer_prefix: str = "model.layers.{i}."
    activation: str = "silu"
    positions: str = ""  # learned absolute position embeddings' HF name
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: str = ""  # "" (dense) | "mixtral" | "qwen" (config names of the MoE settings)
    extra_config: dict[str, Any] = field(default_factory=dict)

    def layer_maps(self, features: set[str]) -> list[LayerMap]:
        """The layer map entries that exist with ``features`` (e.g. ``{"qkv_bias"}``)."""
        return [m for m in self.layers if not m.when or m.when in features]


_ATTN = (
    LayerMap("self_attention.linear_qkv.weight",
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
             "qkv"),
    LayerMap("self_attention.linear_qkv.bias",
             ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
             "qkv", when="qkv_bias"),
    LayerMap("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    LayerMap("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), when="qk_norm"),
    LayerMap("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), when="qk_norm"),
    LayerMap("input_layernorm.weight", ("input_layernorm.weight",), "norm"),
    LayerMap("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), "norm"),
)
_MLP = (
    LayerMap("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    LayerMap("mlp.linear_fc2.weight", ("mlp.down_proj.weight",)),
)

_MIXTRAL_MOE = (
    LayerMap("mlp.router.weight", ("block_sparse_moe.gate.weight",)),
    LayerMap("mlp.experts.linear_fc1.weight", ("block_sparse_moe.experts.{e}.w1.weight",
                                               "block_sparse_moe.experts.{e}.w3.weight"),
             "glu", expert=True),
    LayerMap("mlp.experts.linear_fc2.weight", ("block_sparse_moe.experts.{e}.w2.weight",),
             expert=True),
)
_QWEN_MOE = (
    LayerMap("mlp.router.weight", ("mlp.gate.weight",)),
    # transformers 5 (save_pretrained(save_original_format=False)): gate_up_proj [experts,
    # 2 x ffn, hidden], each expert [gate; up]; down_proj [experts, hidden, ffn]
    LayerMap("mlp.experts.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight",
                                               "mlp.experts.{e}.up_proj.weight"),
             "glu", expert=True, fused="mlp.experts.gate_up_proj"),
    LayerMap("mlp.experts.linear_fc2.weight", ("mlp.experts.{e}.down_proj.weight",),
             expert=True, fused="mlp.experts.down_proj"),
    LayerMap("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_expert.gate_proj.weight",
                                                      "mlp.shared_expert.up_proj.weight"),
             "glu", when="shared"),
    LayerMap("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",),
             when="shared"),
    LayerMap("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",),
             when="shared"),
)

# GPT-2 stores its linears as Conv1D ([in, out], transposed: ``t``) and its fused c_attn as
# [q; k; v] over all heads (``qkv_cat``), where Megatron-Core groups the rows per head.
_GPT2 = (
    LayerMap("self_attention.linear_qkv.weight", ("attn.c_attn.weight",), "qkv_cat_t"),
    LayerMap("self_attention.linear_qkv.bias", ("attn.c_attn.bias",), "qkv_cat"),
    LayerMap("self_attention.linear_proj.weight", ("attn.c_proj.weight",), "t"),
    LayerMap("self_attention.linear_proj.bias", ("attn.c_proj.bias",)),
    LayerMap("input_layernorm.weight", ("ln_1.weight",), "norm"),
    LayerMap("input_layernorm.bias", ("ln_1.bias",), "norm"),
    LayerMap("pre_mlp_layernorm.weight", ("ln_2.weight",), "norm"),
    LayerMap("pre_mlp_layernorm.bias", ("ln_2.bias",), "norm"),
    LayerMap("mlp.linear_fc1.weight", ("mlp.c_fc.weight",), "t"),
    LayerMap("mlp.linear_fc1.bias", ("mlp.c_fc.bias",)),
    LayerMap("mlp.linear_fc2.weight", ("mlp.c_proj.weight",), "t"),
    LayerMap("mlp.linear_fc2.bias", ("mlp.c_proj.bias",)),
)

ARCHS: dict[str, ArchRule] = {
    "gpt2": ArchRule("gpt2", "GPT2LMHeadModel", "gpt2", _GPT2, normalization="LayerNorm",
                     position="learned_absolute", embed="transformer.wte.weight",
                     final_norm="transformer.ln_f", layer_prefix="transformer.h.{i}.",
                     activation="gelu", positions="transformer.wpe.weight"),
    "llama": ArchRule("llama", "LlamaForCausalLM", "llama", _ATTN + _MLP),
    "mistral": ArchRule("mistral", "MistralForCausalLM", "mistral", _ATTN + _MLP),
    "qwen2": ArchRule("qwen2", "Qwen2ForCausalLM", "qwen2", _ATTN + _MLP, qkv_bias=True),
    "qwen3": ArchRule("qwen3", "Qwen3ForCausalLM", "qwen3", _ATTN + _MLP, qk_norm=True),
    "mixtral": ArchRule("mixtral", "MixtralForCausalLM", "mixtral", _ATTN + _MIXTRAL_MOE,
                        moe="mixtral"),
    "qwen2_moe": ArchRule("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", _ATTN + _QWEN_MOE,
                          qkv_bias=True, moe="qwen"),
    "qwen3_moe": ArchRule("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", _ATTN + _QWEN_MOE,
                          qk_norm=True, moe="qwen"),
}
# architectures whose layers differ (dense then MoE, MTP): planning.hf_layered plans them
FAMILIES: dict[str, Family] = {f.name: f for f in (DEEPSEEK_V3, GLM4_MOE,
                                                               GPT_OSS)}
_BY_ARCHITECTURE: dict[str, ArchRule | Family] = {
    r.architecture: r for r in (*ARCHS.values(), *FAMILIES.values())}
_ALL: dict[str, ArchRule | Family] = {**ARCHS, **FAMILIES}


def rule_named(name: str) -> ArchRule | Family:
    """The rule for ``--hf-arch NAME`` (a rule name or an HF architecture class name)."""
    from ckpt_tool.errors import UsageError

    rule = _ALL.get(name.lower()) or _BY_ARCHITECTURE.get(name)
    if rule is None:
        raise UsageError(f"no conversion rule for architecture {name!r}",
                         hint="supported: " + ", ".join(sorted(_ALL)))
    return rule


def rule_for_config(config: dict[str, Any]) -> ArchRule | Family:
    """The rule of an HF ``config.json`` (by ``architectures``, then ``model_type``)."""
    from ckpt_tool.errors import UnsupportedError

    for arch in config.get("architectures") or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if config.get("model_type") in _ALL:
        return _ALL[config["model_type"]]
    named = ", ".join(config.get("architectures") or ()) or config.get("model_type") or "none"
    raise UnsupportedError(f"no conversion rule for HF architecture {named}",
                           hint="supported: " + ", ".join(sorted(_BY_ARCHITECTURE)))


def features_of_config(rule: ArchRule, config: dict[str, Any]) -> set[str]:
    """Optional tensors the config turns on (``qkv_bias``, ``qk_norm``)."""
    out = set()
    if config.get("qkv_bias", rule.qkv_bias) or config.get("attention_bias"):
        out.add("qkv_bias")
    if rule.qk_norm:
        out.add("qk_norm")
    if rule.moe == "qwen" and config.get("shared_expert_intermediate_size"):
        out.add("shared")
    return out


def moe_layers_check(config: dict[str, Any], rule: ArchRule) -> None:
    """UnsupportedError for MoE configs with dense layers between the MoE ones."""
    from ckpt_tool.errors import UnsupportedError

    if rule.moe and (config.get("mlp_only_layers") or int(config.get("decoder_sparse_step")
                                                          or 1) != 1):
        raise UnsupportedError(f"{rule.architecture} with dense layers among the MoE layers "
                               "(mlp_only_layers / decoder_sparse_step) has no rule yet",
                               hint="every layer must be an MoE layer")


def guess_arch(args: dict[str, Any]) -> str:
    """The HF architecture a Megatron-LM ``args`` describes (``--hf-arch`` overrides)."""
    if args.get("position_embedding_type") == "learned_absolute" \
            and args.get("normalization", "LayerNorm") == "LayerNorm" and not args.get("swiglu"):
        return "gpt2"
    if args.get("multi_latent_attention"):
        return "deepseek_v3"
    if args.get("softmax_type") == "learnable":
        return "gpt_oss"  # attention sinks
    if args.get("num_experts") and args.get("moe_router_score_function") == "sigmoid":
        return "glm4_moe"  # DeepSeek-V3's router, grouped-query attention
    window = args.get("window_size") is not None and int(args["window_size"][0]) >= 0
    if args.get("num_experts"):
        if args.get("moe_shared_expert_intermediate_size"):
            return "qwen2_moe"
        return "qwen3_moe" if args.get("qk_layernorm") and not window else "mixtral"
    if window:
        return "mistral"
    if args.get("qk_layernorm"):
        return "qwen3"
    if args.get("add_qkv_bias") and not args.get("add_bias_linear"):
        return "qwen2"
    return "llama"


def padded_vocab(vocab: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: up to a multiple of ``divisible_by * tp``."""
    m = max(1, divisible_by) * max(1, tp)
    return -(-vocab // m) * m


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _rope_theta(config: dict[str, Any]) -> float:
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta") or (rp.get("rope_theta") if isinstance(rp, dict) else None)
    return float(theta or 10000.0)


# GPT-2's config.json names -> the names the other architectures' configs use
GPT2_CONFIG_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
                     "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
                     "layer_norm_epsilon": "rms_norm_eps"}


def _gpt2_aliases(config: dict[str, Any]) -> dict[str, Any]:
    out = dict(config)
    for old, new in GPT2_CONFIG_NAMES.items():
        if old in config:
            out[new] = config[old]
    out["intermediate_size"] = config.get("n_inner") or 4 * int(out["hidden_size"])
    out.setdefault("tie_word_embeddings", True)
    return out


def args_from_hf_config(config: dict[str, Any], rule: ArchRule, *, tp: int = 1, pp: int = 1,
                        local_spec: bool = False, divisible_by: int = 128) -> dict[str, Any]:
    """Megatron-LM argument values (real argument names) for an HF ``config.json``."""
    config = _gpt2_aliases(config) if rule.name == "gpt2" else config
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab = int(config["vocab_size"])
    dtype = _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"),
                        "float32")
    feats = features_of_config(rule, config)
    seq = int(config.get("max_position_embeddings") or 2048)
    return {
        "num_layers": int(config["num_hidden_layers"]), "hidden_size": hidden,
        "ffn_hidden_size": int(config["intermediate_size"]), "num_attention_heads": heads,
        "kv_channels": head_dim, "group_query_attention": groups != heads,
        "num_query_groups": groups, "max_position_embeddings": seq, "seq_length": seq,
        "position_embedding_type": rule.position, "use_rotary_position_embeddings": True,
        "rotary_base": _rope_theta(config), "rotary_percent": 1.0,
        "normalization": rule.normalization,
        "norm_epsilon": float(config.get("rms_norm_eps") or 1e-5),
        "swiglu": rule.activation == "silu", "add_bias_linear": False,
        "add_qkv_bias": "qkv_bias" in feats, "qk_layernorm": "qk_norm" in feats,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": vocab, "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": padded_vocab(vocab, divisible_by, tp),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1,
        "context_parallel_size": 1, "num_experts": None,
        "transformer_impl": "local" if local_spec else "transformer_engine",
        "params_dtype": dtype, "bf16": dtype == "bfloat16", "fp16": dtype == "float16",
        "ckpt_format": "torch_dist", "tokenizer_type": "HuggingFaceTokenizer",
        "hf_architecture": rule.architecture, "window_size": window_from_hf(config, rule.name),
    } | _moe_args(config, rule) | _gpt2_args(config, rule)


def _gpt2_args(config: dict[str, Any], rule: ArchRule) -> dict[str, Any]:
    if rule.name != "gpt2":
        return {}
    act = config.get("activation_function", "gelu_new")
    if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        from ckpt_tool.errors import UnsupportedError

        raise UnsupportedError(f"GPT-2 activation_function {act!r} has no Megatron-Core "
                               "equivalent", hint="gelu (exact) or gelu_new (tanh)")
    return {"add_bias_linear": True, "add_qkv_bias": True, "swiglu": False,
            "use_rotary_position_embeddings": False, "openai_gelu": act != "gelu",
            "qk_layernorm": False}


def _moe_args(config: dict[str, Any], rule: ArchRule) -> dict[str, Any]:
    if not rule.moe:
        return {}
    experts = config.get("num_local_experts") or config.get("num_experts")
    if not experts or "num_experts_per_tok" not in config:
        from ckpt_tool.errors import InputError

        raise InputError(f"{rule.architecture} config.json names no expert count "
                         "(num_local_experts / num_experts) or num_experts_per_tok",
                         hint="fix config.json or pass --hf-config")
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return {
        "num_experts": int(experts), "moe_router_topk": int(config["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(config.get("moe_intermediate_size")
                                   or config["intermediate_size"]),
        "moe_shared_expert_intermediate_size": shared or None,
        "moe_shared_expert_gate": bool(shared),
        # Mixtral renormalises the top-k probabilities (softmax over the top-k logits);
        # Qwen MoE does so only with norm_topk_prob, else softmax first, then top-k
        "moe_router_pre_softmax": rule.moe == "qwen" and not config.get("norm_topk_prob"),
        "moe_router_score_function": "softmax", "moe_grouped_gemm": False,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef") or 0.0),
        "moe_token_dispatcher_type": "alltoall", "expert_tensor_parallel_size": 1,
    }


def hf_config_from_args(args: dict[str, Any], rule: ArchRule, *, vocab: int,
                        dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """An HF ``config.json`` for a Megatron-LM ``args`` (values of ``base`` win: an
    ``--hf-config`` file fills what args lack and fixes what they describe differently)."""
    heads = int(args["num_attention_heads"])
    hidden = int(args["hidden_size"])
    groups = int(args.get("num_query_groups") or heads) if args.get("group_query_attention",
                                                                     True) else heads
    seq = int(args.get("max_position_embeddings") or args.get("seq_length") or 2048)
    cfg: dict[str, Any] = {
        "architectures": [rule.architecture], "model_type": rule.model_type,
        "hidden_size": hidden, "intermediate_size": int(args["ffn_hidden_size"]),
        "num_hidden_layers": int(args["num_layers"]), "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(args.get("kv_channels") or hidden // heads),
        "max_position_embeddings": seq, "rms_norm_eps": float(args.get("norm_epsilon") or 1e-5),
        "rope_theta": float(args.get("rotary_base") or 10000.0), "hidden_act": rule.activation,
        "vocab_size": int(vocab),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "torch_dtype": dtype, "use_cache": True,
    }
    if not rule.qkv_bias:
        cfg["attention_bias"] = False
    window = sliding_window_of(args, rule.name)  # raises where the rule has no window
    if rule.name in WINDOW_ARCHS:  # explicit: MistralConfig's default is 4096
        cfg["sliding_window"] = window
    if rule.moe:
        experts, topk = int(args["num_experts"]), int(args.get("moe_router_topk") or 2)
        moe_ffn = int(args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"])
        if rule.moe == "mixtral":
            cfg.update(num_local_experts=experts, num_experts_per_tok=topk,
                       intermediate_size=moe_ffn)
        else:
            shared = int(args.get("moe_shared_expert_intermediate_size") or 0)
            # transformers 5 spells Qwen3-MoE's count num_local_experts, older ones num_experts
            cfg.update(num_experts=experts, num_local_experts=experts, num_experts_per_tok=topk,
                       moe_intermediate_size=moe_ffn, decoder_sparse_step=1, mlp_only_layers=[],
                       norm_topk_prob=not args.get("moe_router_pre_softmax", False))
            if shared:
                cfg["shared_expert_intermediate_size"] = shared
        cfg["router_aux_loss_coef"] = float(args.get("moe_aux_loss_coeff") or 0.0)
    if rule.name == "gpt2":
        cfg = {"architectures": [rule.architecture], "model_type": "gpt2", "n_embd": hidden,
               "n_layer": cfg["num_hidden_layers"], "n_head": heads, "n_positions": seq,
               "n_inner": cfg["intermediate_size"], "layer_norm_epsilon": cfg["rms_norm_eps"],
               "activation_function": "gelu_new" if args.get("openai_gelu") else "gelu",
               "vocab_size": int(vocab), "tie_word_embeddings": cfg["tie_word_embeddings"],
               "torch_dtype": dtype, "scale_attn_weights": True, "use_cache": True}
    cfg.update(rule.extra_config)
    cfg.update(base or {})
    return cfg
