"""GLM-4.5 (``Glm4MoeForCausalLM``: grouped-query attention with q/k/v biases, qk-norm and
partial rotary, a dense layer then MoE layers with a sigmoid router, expert bias, group-limited
routing and a shared expert, one MTP layer) <-> Megatron-Core, proven by logits; the
Megatron-Core jobs run in one ``torchrun`` of 4 gloo ranks at TP2 x EP2 (``_hf_moe_worker.py``:
the real model from Megatron-Core's own specs).

* transformers -> ``convert --to torch_dist --tp 2 --local-spec`` -> the real Megatron-Core
  model built from the ``args`` the conversion wrote, loaded as Megatron-LM loads (complete
  sharded state dict, default strictness) gives transformers' logits: experts per expert plus
  an MTP layer ``model.layers.3.*`` as GLM's releases hold it, and transformers 5's fused
  experts.
* a checkpoint the real Megatron-Core saves (MTP, seeded expert biases) -> ``convert --to hf``
  (architecture from the args) -> transformers gives Megatron's logits, experts per expert and
  fused.
* an HF config that contradicts the weights (``head_dim``) is refused: one line, exit 2,
  nothing written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _hf_jobs import ckpt, tensors
from test_hf_logits_deepseek import TOKENS, _add_mtp, _logits, _refused
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.multiproc, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_hf_moe_worker.py"


def _model(seed: int):
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        attention_bias=True, use_qk_norm=True, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.5 * torch.randn_like(b))
    return model


def _gqa_config(args) -> dict:
    """The ``TransformerConfig`` fields (and ``GPTModel`` arguments) Megatron-LM derives from
    these ``args``."""
    return dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                ffn_hidden_size=args.ffn_hidden_size, qk_layernorm=args.qk_layernorm,
                add_qkv_bias=args.add_qkv_bias, add_bias_linear=args.add_bias_linear,
                layernorm_epsilon=args.norm_epsilon, num_moe_experts=args.num_experts,
                moe_layer_freq=list(args.moe_layer_freq),
                moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=args.moe_shared_expert_gate,
                moe_router_topk=args.moe_router_topk,
                moe_router_score_function=args.moe_router_score_function,
                moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
                moe_router_num_groups=args.moe_router_num_groups,
                moe_router_group_topk=args.moe_router_group_topk,
                moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
                moe_router_dtype=args.moe_router_dtype,
                moe_router_load_balancing_type=args.moe_router_load_balancing_type,
                gpt=dict(rotary_percent=args.rotary_percent, rotary_base=args.rotary_base))


def _load_job(tmp: Path, name: str) -> dict:
    args = open_checkpoint(tmp / name).common()["args"]
    return dict(name=name, mode="load", ckpt=str(tmp / name), out=str(tmp / f"{name}.pt"),
                tp=args.tensor_model_parallel_size, ep=2, config=_gqa_config(args),
                vocab=args.padded_vocab_size, vocab_out=args.vocab_size,
                seq=args.seq_length, mtp=bool(args.mtp_num_layers), tokens=TOKENS)


SHAPE = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, ffn_hidden_size=96, qk_layernorm=True, add_qkv_bias=True,
             num_moe_experts=4, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=16,
             moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=False,
             moe_router_topk=2, moe_router_score_function="sigmoid",
             moe_router_enable_expert_bias=True, moe_router_num_groups=2,
             moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
             moe_router_load_balancing_type="seq_aux_loss", layernorm_epsilon=1e-5)
ARGS = dict(num_layers=3, encoder_num_layers=3, hidden_size=64, ffn_hidden_size=96,
            num_attention_heads=4, group_query_attention=True, num_query_groups=2,
            kv_channels=16, seq_length=16, max_position_embeddings=16, normalization="RMSNorm",
            norm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=True, qk_layernorm=True,
            rotary_percent=0.5, rotary_base=10000, vocab_size=128, padded_vocab_size=128,
            make_vocab_size_divisible_by=64, num_experts=4, moe_layer_freq=[0, 1, 1],
            moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
            moe_shared_expert_gate=False, moe_router_topk=2,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=2, moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5, mtp_num_layers=1, moe_grouped_gemm=False,
            sequence_parallel=True)
SAVE = dict(name="glm_save", mode="save", tp=2, ep=2,
            config={**SHAPE, "gpt": {"rotary_percent": 0.5, "rotary_base": 10000}},
            args=ARGS, vocab=128, vocab_out=128, seq=16, mtp=True, tokens=TOKENS, seed=5)
IMPORTS = ("glm", "glm_fused")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_glm4_moe")
    model = _model(41)
    model.save_pretrained(tmp / "glm_src")
    _add_mtp(tmp / "glm_src")
    model.save_pretrained(tmp / "glm_fused_src", save_original_format=False)
    jobs = []
    for name in IMPORTS:
        ckpt("convert", tmp / f"{name}_src", tmp / name, "--to", "torch_dist", "--tp", "2",
             "--local-spec")
        jobs.append(_load_job(tmp, name))
    jobs.append(dict(SAVE, ckpt=str(tmp / "glm_save"), out=str(tmp / "glm_save.pt")))
    (tmp / "spec.json").write_text(json.dumps({"jobs": jobs}))
    torchrun(str(WORKER), 4, str(tmp / "spec.json"), timeout=900)
    return tmp


@pytest.mark.parametrize("name", IMPORTS)
def test_hf_to_torch_dist_gives_transformers_logits(runs, name):
    got = torch.load(runs / f"{name}.pt")
    torch.testing.assert_close(got, _logits(runs / f"{name}_src"), rtol=1e-4, atol=1e-5)


def test_import_args_are_megatron_lm_names(runs):
    args = vars(open_checkpoint(runs / "glm").common()["args"])
    assert args["rotary_percent"] == 0.5 and args["add_qkv_bias"] is True
    assert args["qk_layernorm"] is True and args["num_query_groups"] == 2
    assert args["moe_layer_freq"] == [0, 1, 1] and args["mtp_num_layers"] == 1
    assert args["moe_router_score_function"] == "sigmoid"
    assert (args["moe_router_num_groups"], args["moe_router_group_topk"]) == (2, 1)
    keys = open_checkpoint(runs / "glm").metadata().tensors
    assert keys["decoder.layers.1.mlp.router.expert_bias"].dtype == "float32"
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in keys


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_megatron_save_to_hf_gives_megatron_logits(runs, layout):
    out = runs / f"glm_save_hf_{layout}"
    ckpt("convert", runs / "glm_save", out, "--to", "hf", "--hf-experts", layout)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Glm4MoeForCausalLM"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    keys = tensors(out)
    assert ("model.layers.1.mlp.experts.gate_up_proj" in keys) == (layout == "fused")
    assert "model.layers.3.eh_proj.weight" in keys  # the MTP layer, as GLM's releases
    torch.testing.assert_close(_logits(out), torch.load(runs / "glm_save.pt"), rtol=1e-4,
                               atol=1e-5)


def test_round_trip_is_bit_exact(runs):
    for name in IMPORTS:
        back = runs / f"{name}_back"
        ckpt("convert", runs / name, back, "--to", "hf")
        src, got = tensors(runs / f"{name}_src"), tensors(back)
        extra = {k for k in got if k.endswith(("layers.3.embed_tokens.weight",
                                               "layers.3.shared_head.head.weight"))}
        assert got.keys() - extra == src.keys() - extra
        for k in src.keys() - extra:
            assert torch.equal(got[k], src[k]), k


def test_config_contradicting_the_weights_is_refused(runs, tmp_path):
    bad = tmp_path / "bad.json"
    config = json.loads((runs / "glm_src" / "config.json").read_text())
    bad.write_text(json.dumps({**config, "head_dim": 8}))
    out = _refused(runs / "glm_src", tmp_path / "mc", "--to", "torch_dist", "--hf-config",
                   str(bad))
    assert "q_proj" in out
