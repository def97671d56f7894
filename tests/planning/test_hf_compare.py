"""``diff``'s view of a Megatron checkpoint in HF names (``planning.hf_compare``), on metadata
alone: which side is mapped, the HF tensors and where each comes from, the notes on what HF
cannot hold (optimizer state, padded vocab rows, extra state), the tied lm_head."""

from __future__ import annotations

import pytest

from ckpt_tool.errors import InputError
from ckpt_tool.model import CheckpointMeta, TensorMeta
from ckpt_tool.planning.hf_compare import mapped_side, plan_hf_view

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


def meta_of(shapes: dict, fmt: str) -> CheckpointMeta:
    return CheckpointMeta(format=fmt, root="/ckpt", tensors={
        k: TensorMeta(key=k, dtype="bfloat16", shape=s) for k, s in shapes.items()})


def mcore(layers: int = 2, optimizer: bool = True) -> CheckpointMeta:
    L = "decoder.layers."
    shapes = {"embedding.word_embeddings.weight": (128, 64),
              "decoder.final_layernorm.weight": (64,),
              L + "self_attention.linear_qkv.weight": (layers, 128, 64),
              L + "self_attention.linear_qkv.layer_norm_weight": (layers, 64),
              L + "self_attention.linear_proj.weight": (layers, 64, 64),
              L + "mlp.linear_fc1.weight": (layers, 192, 64),
              L + "mlp.linear_fc1.layer_norm_weight": (layers, 64),
              L + "mlp.linear_fc2.weight": (layers, 64, 96)}
    if optimizer:
        shapes.update({"optimizer.state.exp_avg." + k: s for k, s in list(shapes.items())})
    return meta_of(shapes, "torch_dist")


def hf(tied_copy: bool) -> CheckpointMeta:
    shapes = {"model.embed_tokens.weight": (100, 64), "model.rotary_emb.inv_freq": (8,)}
    if tied_copy:
        shapes["lm_head.weight"] = (100, 64)
    return meta_of(shapes, "hf")


def test_which_side_is_mapped():
    assert mapped_side("torch_dist", "hf") == "a" and mapped_side("hf", "legacy") == "b"
    assert mapped_side("zarr", "hf") == "a"
    for pair in (("hf", "hf"), ("torch_dist", "torch_dist"), ("dcp", "hf"), ("hf", "torch")):
        assert mapped_side(*pair) is None


@pytest.mark.parametrize("tied_copy", [False, True])
def test_view_names_origins_and_notes(tied_copy):
    view = plan_hf_view(mcore(), {}, hf(tied_copy), CONFIG, side="b")
    shapes = {r.key: r.shape for r in view.recipes}
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (32, 64)
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (96, 64)
    assert shapes["model.embed_tokens.weight"] == (100, 64)
    assert ("lm_head.weight" in shapes) == tied_copy  # the tied copy maps to the embedding
    assert view.origins["model.layers.1.self_attn.k_proj.weight"] == \
        "decoder.layers.self_attention.linear_qkv.weight[1] (key rows of each query group)"
    assert view.origins["model.layers.0.input_layernorm.weight"] == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight[0]"
    assert view.origins["model.embed_tokens.weight"] == \
        "embedding.word_embeddings.weight (rows 0-99)"
    assert len(view.recipes) == 3 + 2 * 9 + tied_copy - 1  # no lm_head of its own
    assert view.notes == (
        "optimizer state not comparable: A (hf) holds model weights only; B's: 8 tensors "
        "(optimizer.state.exp_avg.decoder.final_layernorm.weight, optimizer.state.exp_avg."
        "decoder.layers.mlp.linear_fc1.layer_norm_weight, optimizer.state.exp_avg.decoder."
        "layers.mlp.linear_fc1.weight, …)",
        "padded vocab rows not comparable: B's embedding.word_embeddings.weight has 128 rows, "
        "A (hf) holds vocab_size 100; rows 100-127 not compared",
        "rotary buffers not comparable: B (torch_dist) holds none; A's: 1 tensor "
        "(model.rotary_emb.inv_freq)")


def test_a_config_that_contradicts_the_weights_cannot_map():
    with pytest.raises(InputError, match=r"contradicts the weights: no self_attention"
                                         r"\.linear_qkv\.weight for layer 0 \(3 layers\)"):
        plan_hf_view(mcore(), {}, hf(False), {**CONFIG, "num_hidden_layers": 3})


def test_config_compared_with_args_through_the_rules():
    from ckpt_tool.planning.hf_compare import config_differences
    from ckpt_tool.planning.hf_rules import args_from_hf_config, rule_for_config

    rule = rule_for_config(CONFIG)
    args = args_from_hf_config(CONFIG, rule)
    assert config_differences(args, CONFIG, rule) == []
    assert config_differences({}, CONFIG, rule) == []  # no args: nothing to compare
    # a stored int rope base and no kv_channels (hidden / heads) are the same settings
    same = {**args, "rotary_base": 10000, "kv_channels": None}
    assert config_differences(same, CONFIG, rule) == []
    edited = {**CONFIG, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
              "tie_word_embeddings": False, "vocab_size": 99}
    assert config_differences(args, edited, rule) == [
        ("args.num_query_groups / config.json num_key_value_heads", 2, 4),
        ("args.vocab_size / config.json vocab_size", 100, 99),
        ("args.norm_epsilon / config.json rms_norm_eps", 1e-6, 1e-5),
        ("args.rotary_base / config.json rope_theta", 10000.0, 5e5),
        ("args.untie_embeddings_and_output_weights / config.json tie_word_embeddings", False,
         False)]
    # GPT-2's names; no rope; group_query_attention off means one group per head
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
            "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 100}
    g_rule = rule_for_config(gpt2)
    g_args = {**args_from_hf_config(gpt2, g_rule), "num_query_groups": 1,
              "group_query_attention": False, "rotary_base": 1.0}
    assert config_differences(g_args, gpt2, g_rule) == []
    assert config_differences({**g_args, "hidden_size": 32, "ffn_hidden_size": 128}, gpt2,
                              g_rule) == [("args.hidden_size / config.json n_embd", 32, 64),
                                          ("args.ffn_hidden_size / config.json n_inner", 128,
                                           256)]  # no n_inner: 4 x n_embd
