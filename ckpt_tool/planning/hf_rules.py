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

__all__ = ["ArchRule", "LayerMap", "ARCHS", "rule_for_config", "rule_named", "guess_arch",
           "args_from_hf_config", "hf_config_from_args", "padded_vocab", "TE_NORMS"]

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
    when: str = ""  # a config feature the tensor exists under (see ``ArchRule.features``)


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

ARCHS: dict[str, ArchRule] = {
    "llama": ArchRule("llama", "LlamaForCausalLM", "llama", _ATTN + _MLP),
    "mistral": ArchRule("mistral", "MistralForCausalLM", "mistral", _ATTN + _MLP),
    "qwen2": ArchRule("qwen2", "Qwen2ForCausalLM", "qwen2", _ATTN + _MLP),
    "qwen3": ArchRule("qwen3", "Qwen3ForCausalLM", "qwen3", _ATTN + _MLP),
}
_BY_ARCHITECTURE = {r.architecture: r for r in ARCHS.values()}


def rule_named(name: str) -> ArchRule:
    """The rule for ``--hf-arch NAME`` (a rule name or an HF architecture class name)."""
    from ckpt_tool.errors import UsageError

    rule = ARCHS.get(name.lower()) or _BY_ARCHITECTURE.get(name)
    if rule is None:
        raise UsageError(f"no conversion rule for architecture {name!r}",
                         hint="supported: " + ", ".join(sorted(ARCHS)))
    return rule


def rule_for_config(config: dict[str, Any]) -> ArchRule:
    """The rule of an HF ``config.json`` (by ``architectures``, then ``model_type``)."""
    from ckpt_tool.errors import UnsupportedError

    for arch in config.get("architectures") or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    if config.get("model_type") in ARCHS:
        return ARCHS[config["model_type"]]
    named = ", ".join(config.get("architectures") or ()) or config.get("model_type") or "none"
    raise UnsupportedError(f"no conversion rule for HF architecture {named}",
                           hint="supported: " + ", ".join(sorted(
                               r.architecture for r in ARCHS.values())))


def features_of_config(rule: ArchRule, config: dict[str, Any]) -> set[str]:
    """Optional tensors the config turns on (``qkv_bias``, ``qk_norm``)."""
    out = set()
    if rule.name == "qwen2" or config.get("attention_bias"):
        out.add("qkv_bias")
    if rule.name == "qwen3":
        out.add("qk_norm")
    return out


def guess_arch(args: dict[str, Any]) -> str:
    """The HF architecture a Megatron-LM ``args`` describes (``--hf-arch`` overrides)."""
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


def args_from_hf_config(config: dict[str, Any], rule: ArchRule, *, tp: int = 1, pp: int = 1,
                        local_spec: bool = False, divisible_by: int = 128) -> dict[str, Any]:
    """Megatron-LM argument values (real argument names) for an HF ``config.json``."""
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
        "hf_architecture": rule.architecture,
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
    if rule.name != "qwen2":
        cfg["attention_bias"] = False
    cfg.update(rule.extra_config)
    cfg.update(base or {})
    return cfg
