"""HF <-> Megatron-Core architecture rules and recipes, on metadata alone (no I/O), and the
transforms they name, executed on small tensors (QKV per query group, SwiGLU halves, vocab
rows)."""

from __future__ import annotations

import pytest
import torch

from ckpt_tool.errors import InputError, UnsupportedError, UsageError
from ckpt_tool.model import CheckpointMeta, TensorMeta
from ckpt_tool.ops._hf_source import apply_part
from ckpt_tool.planning.hf_plan import Part, plan_export, plan_import
from ckpt_tool.planning.hf_rules import (ARCHS, args_from_hf_config, guess_arch,
                                         hf_config_from_args, padded_vocab, rule_for_config,
                                         rule_named)

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 5e5}, "dtype": "bfloat16",
          "tie_word_embeddings": False}


def meta_of(shapes: dict[str, tuple[int, ...]], dtype: str = "bfloat16") -> CheckpointMeta:
    return CheckpointMeta(format="x", root="/ckpt", tensors={
        k: TensorMeta(key=k, dtype=dtype, shape=s) for k, s in shapes.items()})


def hf_llama(layers: int = 2, bias: bool = False, tied: bool = False) -> CheckpointMeta:
    shapes = {"model.embed_tokens.weight": (100, 64), "model.norm.weight": (64,)}
    if not tied:
        shapes["lm_head.weight"] = (100, 64)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, 64),
                       p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64),
                       p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                       p + "mlp.down_proj.weight": (64, 96),
                       p + "input_layernorm.weight": (64,),
                       p + "post_attention_layernorm.weight": (64,)})
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (64,), p + "self_attn.k_proj.bias": (32,),
                           p + "self_attn.v_proj.bias": (32,)})
    return meta_of(shapes)


def test_config_to_args_and_back():
    rule = rule_for_config(CONFIG)
    args = args_from_hf_config(CONFIG, rule, tp=2)
    assert args["num_query_groups"] == 2 and args["kv_channels"] == 16
    assert args["padded_vocab_size"] == 256 and args["rotary_base"] == 5e5
    assert args["normalization"] == "RMSNorm" and args["swiglu"] and not args["add_bias_linear"]
    assert args["untie_embeddings_and_output_weights"] and args["params_dtype"] == "bfloat16"
    back = hf_config_from_args(args, rule, vocab=100, dtype="bfloat16")
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
              "tie_word_embeddings"):
        assert back[k] == CONFIG[k], k
    assert back["rope_theta"] == 5e5 and back["architectures"] == ["LlamaForCausalLM"]
    assert hf_config_from_args(args, rule, vocab=100, dtype="bfloat16",
                               base={"eos_token_id": 7})["eos_token_id"] == 7


def test_rule_lookup_and_unknown_architecture():
    assert rule_named("Qwen2ForCausalLM") is ARCHS["qwen2"]
    assert guess_arch({"add_qkv_bias": True}) == "qwen2" and guess_arch({}) == "llama"
    with pytest.raises(UnsupportedError, match="no conversion rule for HF architecture "
                                               "FalconForCausalLM"):
        rule_for_config({"architectures": ["FalconForCausalLM"]})
    with pytest.raises(UsageError, match="no conversion rule"):
        rule_named("falcon")
    assert padded_vocab(100, 128, 2) == 256 and padded_vocab(128, 64, 2) == 128


def test_import_plan_stacks_layers_with_te_norm_names():
    rule = rule_for_config(CONFIG)
    args = args_from_hf_config(CONFIG, rule, tp=1)
    recipes = {r.key: r for r in plan_import(hf_llama(), CONFIG, rule, args)}
    assert set(recipes) == {
        "decoder.layers.self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.linear_proj.weight",
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
        "embedding.word_embeddings.weight", "output_layer.weight",
        "decoder.final_layernorm.weight"}
    qkv = recipes["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape == (2, 128, 64) and qkv.dtype == "bfloat16"
    assert [p.index for p in qkv.parts] == [(0,), (1,)] and qkv.parts[1].op == "qkv_fuse"
    assert recipes["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 192, 64)
    assert recipes["embedding.word_embeddings.weight"].shape == (128, 64)  # re-padded


def test_import_tied_embeddings_and_qkv_bias():
    cfg = {**CONFIG, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
           "tie_word_embeddings": True}
    rule = rule_for_config(cfg)
    args = args_from_hf_config(cfg, rule)
    keys = {r.key for r in plan_import(hf_llama(bias=True, tied=True), cfg, rule, args)}
    assert "output_layer.weight" not in keys
    assert "decoder.layers.self_attention.linear_qkv.bias" in keys
    assert args["add_qkv_bias"] and not args["untie_embeddings_and_output_weights"]


def test_import_contradictions_are_errors():
    rule = rule_for_config(CONFIG)
    args = args_from_hf_config({**CONFIG, "num_hidden_layers": 3}, rule)
    with pytest.raises(InputError, match="contradicts the weights: no tensor "
                                         "model.layers.2.self_attn.q_proj.weight"):
        plan_import(hf_llama(), CONFIG, rule, args)
    args = args_from_hf_config({**CONFIG, "num_key_value_heads": 4}, rule)
    with pytest.raises(InputError, match=r"q/k/v have \[64, 32, 32\] rows"):
        plan_import(hf_llama(), CONFIG, rule, args)
    args = args_from_hf_config(CONFIG, rule)
    with pytest.raises(UnsupportedError, match="1 HF tensor.*model.layers.0.self_attn.q_proj.bias"):
        plan_import(meta_of({**{k: t.shape for k, t in hf_llama().tensors.items()},
                             "model.layers.0.self_attn.q_proj.bias": (64,)}),
                    CONFIG, rule, args)


def mcore_meta(stacked: bool, te: bool = True, bias: bool = False) -> CheckpointMeta:
    per = {"self_attention.linear_qkv.weight": (128, 64),
           "self_attention.linear_proj.weight": (64, 64),
           "mlp.linear_fc1.weight": (192, 64), "mlp.linear_fc2.weight": (64, 96)}
    norms = ({"self_attention.linear_qkv.layer_norm_weight": (64,),
              "mlp.linear_fc1.layer_norm_weight": (64,)} if te else
             {"input_layernorm.weight": (64,), "pre_mlp_layernorm.weight": (64,)})
    per.update(norms)
    if bias:
        per["mlp.linear_fc2.bias"] = (64,)
    shapes = {"embedding.word_embeddings.weight": (128, 64), "output_layer.weight": (128, 64),
              "decoder.final_layernorm.weight": (64,)}
    for name, s in per.items():
        if stacked:
            shapes[f"decoder.layers.{name}"] = (2, *s)
        else:
            shapes.update({f"decoder.layers.{i}.{name}": s for i in range(2)})
    return meta_of(shapes)


@pytest.mark.parametrize("stacked,te", [(True, True), (False, False), (False, True)])
def test_export_plan_reads_stacked_or_per_layer_and_either_norm_name(stacked, te):
    rule = rule_named("llama")
    args = args_from_hf_config(CONFIG, rule)
    recipes = {r.key: r for r in plan_export(mcore_meta(stacked, te), args, rule, vocab=100)}
    assert set(recipes) == set(hf_llama().tensors)
    q = recipes["model.layers.1.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and q.parts[0].op == "qkv_split"
    src = q.parts[0].sources[0]
    assert (src.key, src.index) == (("decoder.layers.self_attention.linear_qkv.weight", (1,))
                                    if stacked else
                                    ("decoder.layers.1.self_attention.linear_qkv.weight", ()))
    assert recipes["model.embed_tokens.weight"].shape == (100, 64)  # padding dropped
    assert recipes["model.layers.0.mlp.up_proj.weight"].parts[0].params == (("half", 1),)


def test_export_refuses_weights_the_architecture_cannot_hold():
    rule = rule_named("llama")
    args = args_from_hf_config(CONFIG, rule)
    with pytest.raises(UnsupportedError, match="2 model tensor.*no place in LlamaForCausalLM: "
                                               "decoder.layers.0.mlp.linear_fc2.bias"):
        plan_export(mcore_meta(False, bias=True), args, rule, vocab=100)
    with pytest.raises(InputError, match="128 rows, 4 query groups of 1 heads x 16 need 192"):
        plan_export(mcore_meta(True), {**args, "num_query_groups": 4}, rule, vocab=100)


def test_qkv_transforms_follow_megatron_query_groups():
    groups, qpg, hd, hidden = 2, 3, 2, 5
    geo = (("groups", groups), ("q_per_group", qpg), ("head_dim", hd))
    q = torch.arange(groups * qpg * hd * hidden, dtype=torch.float32).reshape(-1, hidden)
    k = -torch.arange(groups * hd * hidden, dtype=torch.float32).reshape(-1, hidden) - 1
    v = k - 1000
    fused = apply_part(Part((), "qkv_fuse", (), geo), [q, k, v])
    # group 0: its 3 query heads, then k head 0, then v head 0; then group 1
    rows = hd * qpg
    assert torch.equal(fused[:rows], q[:rows])
    assert torch.equal(fused[rows:rows + hd], k[:hd])
    assert torch.equal(fused[rows + hd:rows + 2 * hd], v[:hd])
    assert torch.equal(fused[rows + 2 * hd:2 * rows + 2 * hd], q[rows:])
    for part, want in enumerate((q, k, v)):
        got = apply_part(Part((), "qkv_split", (), (("part", part),) + geo), [fused])
        assert torch.equal(got, want)
    bias = apply_part(Part((), "qkv_fuse", (), geo), [q[:, 0], k[:, 0], v[:, 0]])
    assert torch.equal(bias, fused[:, 0])


def test_glu_and_vocab_rows():
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    fc1 = apply_part(Part((), "glu_fuse", ()), [gate, up])
    assert torch.equal(fc1[:4], gate) and torch.equal(fc1[4:], up)
    assert torch.equal(apply_part(Part((), "glu_split", (), (("half", 1),)), [fc1]), up)
    emb = torch.randn(5, 2, dtype=torch.bfloat16)
    padded = apply_part(Part((), "rows", (), (("rows", 8),)), [emb])
    assert padded.shape == (8, 2) and padded.dtype == torch.bfloat16
    assert torch.equal(padded[:5], emb) and not padded[5:].any()
    assert torch.equal(apply_part(Part((), "rows", (), (("rows", 5),)), [padded]), emb)


def gpt2_meta(groups: int, heads: int = 4, hd: int = 16, layers: int = 2) -> CheckpointMeta:
    hidden, qkv = heads * hd, groups * (heads // groups + 2) * hd
    per = {"self_attention.linear_qkv.weight": (qkv, hidden), "self_attention.linear_qkv.bias":
           (qkv,), "self_attention.linear_proj.weight": (hidden, hidden),
           "self_attention.linear_proj.bias": (hidden,),
           "self_attention.linear_qkv.layer_norm_weight": (hidden,),
           "self_attention.linear_qkv.layer_norm_bias": (hidden,),
           "mlp.linear_fc1.layer_norm_weight": (hidden,),
           "mlp.linear_fc1.layer_norm_bias": (hidden,),
           "mlp.linear_fc1.weight": (4 * hidden, hidden), "mlp.linear_fc1.bias": (4 * hidden,),
           "mlp.linear_fc2.weight": (hidden, 4 * hidden), "mlp.linear_fc2.bias": (hidden,)}
    shapes = {f"decoder.layers.{k}": (layers, *s) for k, s in per.items()}
    shapes.update({"embedding.word_embeddings.weight": (128, hidden),
                   "embedding.position_embeddings.weight": (32, hidden),
                   "decoder.final_layernorm.weight": (hidden,),
                   "decoder.final_layernorm.bias": (hidden,)})
    return meta_of(shapes)


def gpt2_args(groups: int, heads: int = 4) -> dict:
    return {"num_layers": 2, "hidden_size": 64, "num_attention_heads": heads, "kv_channels": 16,
            "num_query_groups": groups, "group_query_attention": groups != heads,
            "ffn_hidden_size": 256}


def test_gpt2_export_refuses_grouped_query_attention():
    rule = rule_named("gpt2")
    # one group per head: c_attn is [q; k; v] over the 4 heads, transposed (Conv1D)
    recipes = {r.key: r for r in plan_export(gpt2_meta(4), gpt2_args(4), rule, vocab=100)}
    c_attn = recipes["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (64, 192) and c_attn.parts[0].op == "qkv_to_cat"
    # 2 query groups for 4 heads: k/v have half the rows of q, which c_attn has no room for
    with pytest.raises(UnsupportedError) as info:
        plan_export(gpt2_meta(2), gpt2_args(2), rule, vocab=100)
    assert info.value.one_line() == (
        "/ckpt: GPT2LMHeadModel has no grouped-query attention; this checkpoint has 2 query "
        "groups for 4 heads (pass --hf-arch llama, mistral or qwen2 if the other weights fit "
        "those architectures; otherwise use --to safetensors)")
    # group_query_attention off: Megatron-LM ignores num_query_groups, one group per head
    assert plan_export(gpt2_meta(4), {**gpt2_args(4), "num_query_groups": 2}, rule, vocab=100)


def test_gpt2_token_ids_from_the_tokenizer_or_unknown():
    from ckpt_tool.planning.hf_extras import gpt2_token_ids

    gpt2 = {"bos_token_id": 50256, "eos_token_id": 50256}
    assert gpt2_token_ids({"tokenizer_type": "GPT2BPETokenizer"}, 50257) == (gpt2, None)
    assert gpt2_token_ids({"tokenizer_type": "HuggingFaceTokenizer",
                           "tokenizer_model": "/models/gpt2"}, 50257) == (gpt2, None)
    assert gpt2_token_ids({}, 50257) == (gpt2, None)  # GPT-2's vocabulary size, no tokenizer
    # NullTokenizer(--vocab-size 99) ends documents with id 99
    assert gpt2_token_ids({"tokenizer_type": "NullTokenizer", "vocab_size": 99}, 100) == (
        {"bos_token_id": 99, "eos_token_id": 99}, None)
    for args, vocab in (({"tokenizer_type": "NullTokenizer", "vocab_size": 128}, 128),
                        ({"tokenizer_type": "HuggingFaceTokenizer"}, 50257),
                        ({"tokenizer_type": "GPT2BPETokenizer"}, 1000), ({}, 100)):
        ids, note = gpt2_token_ids(args, vocab)
        assert ids == {"bos_token_id": None, "eos_token_id": None}, args
        assert note.startswith("bos/eos token ids unknown (tokenizer: "), args


def test_mistral_sliding_window_to_window_size_and_back():
    cfg = {**CONFIG, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
           "sliding_window": 4096}
    rule = rule_for_config(cfg)
    args = args_from_hf_config(cfg, rule)
    # transformers' window of 4096 keys (i-4095..i) is Megatron-Core's (4095, 0)
    assert args["window_size"] == (4095, 0) and guess_arch(args) == "mistral"
    assert hf_config_from_args(args, rule, vocab=100, dtype="bfloat16")["sliding_window"] == 4096
    no_window = args_from_hf_config({**cfg, "sliding_window": None}, rule)
    assert no_window["window_size"] is None and guess_arch(no_window) == "llama"
    # MistralConfig's default window is 4096: no window is written as null
    back = hf_config_from_args(no_window, rule, vocab=100, dtype="bfloat16")
    assert "sliding_window" in back and back["sliding_window"] is None
    assert hf_config_from_args({**args, "window_size": (-1, 0)}, rule, vocab=100,
                               dtype="bfloat16")["sliding_window"] is None
    assert args_from_hf_config(cfg, rule_named("llama"))["window_size"] is None
    with pytest.raises(UnsupportedError, match=r"sliding-window attention \(window_size "
                                               r"\(4095, 0\)\).*llama.*--hf-arch mistral"):
        hf_config_from_args(args, rule_named("llama"), vocab=100, dtype="bfloat16")
    with pytest.raises(UnsupportedError, match=r"window_size \(4095, 0\) with "
                                               r"window_attn_skip_freq 4 has no Hugging Face"):
        hf_config_from_args({**args, "window_attn_skip_freq": 4}, rule, vocab=100,
                            dtype="bfloat16")
