"""Which ``_extra_state`` ShardedObjects a Megatron-Core GPT saves (planning.extra_state),
checked against checkpoints the real Megatron-Core 0.16.1 wrote (local spec, on CPU without
Transformer Engine): a dense TP2 PP2 GPT and a MoE GPT with routed and shared experts."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.model import TensorMeta
from ckpt_tool.planning.extra_state import (EMPTY_UINT8, LOCAL, NONE, TE, extra_state_objects,
                                            legacy_extra_states, legacy_layer_spec,
                                            payload_kind)

FIX = Path(__file__).resolve().parents[2] / "fixtures"
FINAL_NORM = "decoder.final_layernorm._extra_state/shard_0_1"


def _real(name: str):
    path = FIX / name
    if not path.is_dir():
        pytest.skip(f"fixture {name} is missing")
    meta = open_checkpoint(path).metadata()
    return meta, {o.unique_key: o for o in meta.objects if o.key.endswith("._extra_state")}


@pytest.mark.parametrize("name", ["mcore016_gpt_tp2pp2_fp32", "mcore016_moe_ep2_distopt_buckets",
                                  "mcore016_deepseek_tp2ep2_distopt"])
def test_local_spec_objects_are_megatron_cores(name):
    """Every object the real library saved, with its global shape and offset (the layer
    axis, then the global expert axis); a dense model's final norm in addition (a ``TENorm``
    wherever Transformer Engine is installed, which this CPU save had not)."""
    meta, real = _real(name)
    ours = {o.unique_key: o for o in extra_state_objects(meta.tensors, LOCAL)}
    extra = set(ours) - set(real)
    assert extra == ({FINAL_NORM} if name.startswith("mcore016_gpt") else set())
    assert set(real) <= set(ours)
    for key, o in real.items():
        assert (ours[key].key, ours[key].global_shape, ours[key].global_offset) == \
            (o.key, o.global_shape, o.global_offset), key
    assert real  # the fixtures do hold them


def test_te_spec_adds_its_norms_and_payloads():
    t = {k: TensorMeta(k, "float32", s) for k, s in {
        "decoder.layers.self_attention.linear_qkv.weight": (2, 96, 64),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 64),
        "decoder.layers.self_attention.q_layernorm.weight": (2, 16),
        "decoder.layers.pre_mlp_layernorm.weight": (2, 64),
        "decoder.layers.mlp.router.weight": (2, 4, 64),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 64, 32),
        "decoder.final_layernorm.weight": (64,),
        "embedding.word_embeddings.weight": (128, 64),
        "output_layer.weight": (128, 64),
        "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight": (2, 96, 64),
    }.items()}
    te = {o.unique_key for o in extra_state_objects(t, TE)}
    assert te == {"decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2",
                  "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_2",
                  "decoder.layers.self_attention.q_layernorm._extra_state/shard_0_2",
                  "decoder.layers.self_attention.q_layernorm._extra_state/shard_1_2",
                  "decoder.layers.pre_mlp_layernorm._extra_state/shard_0_2",
                  "decoder.layers.pre_mlp_layernorm._extra_state/shard_1_2",
                  FINAL_NORM} | {
        f"decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_{i}.{e}_2.4"
        for i in range(2) for e in range(4)}
    local = {o.unique_key for o in extra_state_objects(t, LOCAL)}
    assert local == {k for k in te if "layernorm" not in k}  # a MoE model: no TENorm at all
    assert payload_kind(TE, FINAL_NORM) == EMPTY_UINT8
    assert payload_kind(LOCAL, "decoder.layers.mlp.linear_fc1._extra_state/shard_0_2") == NONE
    assert payload_kind(LOCAL, FINAL_NORM) == EMPTY_UINT8  # TransformerBlock's TENorm
    assert payload_kind(TE, "output_layer") == NONE  # a ColumnParallelLinear in both specs


def test_legacy_entries_and_spec():
    names = ["decoder.layers.0.input_layernorm.weight",
             "decoder.layers.0.self_attention.linear_qkv.weight",
             "decoder.layers.0.mlp.linear_fc1.weight", "decoder.final_layernorm.weight",
             "output_layer.weight", "embedding.word_embeddings.weight"]
    assert legacy_layer_spec(names) == LOCAL
    assert legacy_extra_states(names, LOCAL) == {
        "decoder.layers.0.self_attention.linear_qkv": NONE,
        "decoder.layers.0.mlp.linear_fc1": NONE, "output_layer": NONE}
    te = [n.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_") for n in names]
    assert legacy_layer_spec(te) == TE
    assert legacy_extra_states(te, TE) == {
        "decoder.layers.0.self_attention.linear_qkv": EMPTY_UINT8,
        "decoder.layers.0.mlp.linear_fc1": EMPTY_UINT8,
        "decoder.final_layernorm": EMPTY_UINT8, "output_layer": NONE}
    assert legacy_layer_spec(["decoder.layers.0.mlp.linear_fc1.weight"],
                             {"transformer_impl": "local"}) == LOCAL
