"""``inspect`` names a model's architecture parts from its stored keys and shapes alone: the
DeepSeek-V3-shaped checkpoint the real Megatron-Core wrote (MLA with its LoRA ranks, routed and
gated shared experts with the router's expert bias in the MoE layers after a dense one, one MTP
layer); a plain GPT has none; the hybrid pattern letters as Megatron-Core spells them."""

from __future__ import annotations

from pathlib import Path

from ckpt_tool.model import TensorMeta
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.planning.model_parts import layer_pattern

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def test_deepseek_parts():
    parts = inspect(FIX / "mcore016_deepseek_tp2ep2_distopt").to_dict()["model_parts"]
    assert parts["attention"] == ("Multi-Latent Attention (q LoRA rank 32, kv LoRA rank 32, "
                                  "rope head dim 8)")
    assert parts["experts"] == ("4 routed experts, MoE layers 1-2, dense layers 0, shared experts "
                                "(gated), router expert bias (aux-loss-free balancing)")
    assert parts["mtp"] == "Multi-Token Prediction, depth 1"
    assert set(parts) == {"attention", "experts", "mtp"}


def test_plain_gpt_has_no_parts():
    assert inspect(FIX / "mcore016_gpt_tp2pp2_fp32").parts == {}


def test_hybrid_layer_pattern():
    keys = ["decoder.layers.0.mixer.in_proj.weight", "decoder.layers.1.self_attention.linear_qkv.weight",
            "decoder.layers.2.mlp.linear_fc1.weight", "decoder.layers.3.mixer.A_log",
            "decoder.layers.4.mlp.experts.experts.linear_fc1.weight"]
    tensors = {k: TensorMeta(key=k, dtype="bfloat16", shape=(4, 4), chunks=()) for k in keys}
    assert layer_pattern(tensors) == "M*-ME"
