"""GPT-OSS (``GptOssForCausalLM``: attention sinks, biases everywhere, alternating sliding
window, clamped SwiGLU experts stored fused with gate/up interleaved, a router with bias, YaRN)
<-> Megatron-Core, proven by logits; the Megatron-Core jobs run in one ``torchrun`` of 4 gloo
ranks at TP2 x EP2 (``_hf_moe_worker.py``: the real model from Megatron-Core's own specs).

* transformers -> ``convert --to torch_dist --tp 2 --local-spec`` -> the real Megatron-Core
  model built from the ``args`` the conversion wrote, loaded as Megatron-LM loads, gives
  transformers' logits;
* a checkpoint the real Megatron-Core saves (sinks, window, clamp, biases seeded) ->
  ``convert --to hf`` -> transformers gives Megatron's logits; the same export with
  ``down_proj`` written un-transposed (the orientation trap) does not;
* an HF config that contradicts the weights (``head_dim``) is refused: one line, exit 2,
  nothing written;
* the same model in the releases' MXFP4 form (``_mxfp4_release.py``: experts as
  ``_blocks``/``_scales``, ``quant_method mxfp4``) imports to the very Megatron tensors its
  bf16 dequantization (transformers' ``convert_moe_packed_tensors``) imports to, and the real
  Megatron-Core gives the logits transformers computes from the MXFP4 directory on CPU
  (``Mxfp4Config(dequantize=True)``: without it transformers 5.25 fetches the triton kernels
  from the Hub).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _hf_jobs import ckpt, tensors
from _mxfp4_release import write_release
from test_hf_logits_deepseek import TOKENS, _logits, _refused
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.multiproc, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_hf_moe_worker.py"
YARN = dict(yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096,
            yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=None,
            yarn_mscale_all_dim=None, yarn_correction_range_round_to_int=False)


def _model(seed: int):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        vocab_size=100, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "gate_up_proj" in name and "bias" not in name:
                p.copy_(torch.randn_like(p))  # some activations past the clamp (7.0)
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _config(args) -> dict:
    """The ``TransformerConfig`` fields and ``GPTModel`` arguments these ``args`` give."""
    out = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
               num_attention_heads=args.num_attention_heads,
               num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
               ffn_hidden_size=args.ffn_hidden_size, add_bias_linear=args.add_bias_linear,
               add_qkv_bias=args.add_qkv_bias, layernorm_epsilon=args.norm_epsilon,
               activation="quick_gelu" if args.quick_geglu else "silu",
               glu_linear_offset=args.glu_linear_offset,
               activation_func_clamp_value=args.activation_func_clamp_value,
               softmax_type=args.softmax_type, window_size=list(args.window_size),
               window_attn_skip_freq=list(args.window_attn_skip_freq),
               num_moe_experts=args.num_experts, moe_layer_freq=list(args.moe_layer_freq),
               moe_ffn_hidden_size=args.moe_ffn_hidden_size,
               moe_router_topk=args.moe_router_topk,
               moe_router_pre_softmax=args.moe_router_pre_softmax,
               gpt=dict(rotary_base=args.rotary_base,
                        position_embedding_type=args.position_embedding_type))
    out.update({k: getattr(args, k) for k in YARN})
    return out


SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, ffn_hidden_size=32, add_bias_linear=True, add_qkv_bias=True,
             layernorm_epsilon=1e-5, activation="quick_gelu", glu_linear_offset=1.0,
             activation_func_clamp_value=7.0, softmax_type="learnable", window_size=[3, 0],
             window_attn_skip_freq=[1, 0], num_moe_experts=4, moe_layer_freq=[1, 1],
             moe_ffn_hidden_size=32, moe_router_topk=2, **YARN,
             gpt=dict(rotary_base=150000.0, position_embedding_type="yarn"))
ARGS = dict(num_layers=2, encoder_num_layers=2, hidden_size=64, ffn_hidden_size=32,
            num_attention_heads=4, group_query_attention=True, num_query_groups=2,
            kv_channels=16, seq_length=16, max_position_embeddings=16, normalization="RMSNorm",
            norm_epsilon=1e-5, add_bias_linear=True, add_qkv_bias=True, swiglu=False,
            quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
            softmax_type="learnable", window_size=(3, 0), window_attn_skip_freq=[1, 0],
            position_embedding_type="yarn", rotary_base=150000.0, vocab_size=128,
            padded_vocab_size=128, make_vocab_size_divisible_by=64, num_experts=4,
            moe_layer_freq=[1, 1], moe_ffn_hidden_size=32, moe_router_topk=2,
            moe_router_score_function="softmax", moe_router_pre_softmax=False,
            moe_grouped_gemm=False, sequence_parallel=True, **YARN)
SAVE = dict(name="oss_save", mode="save", tp=2, ep=2, config=SHAPE, args=ARGS, vocab=128,
            vocab_out=128, seq=16, mtp=False, tokens=TOKENS, seed=7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_gpt_oss")
    _model(51).save_pretrained(tmp / "oss_src")
    ckpt("convert", tmp / "oss_src", tmp / "oss", "--to", "torch_dist", "--tp", "2",
         "--local-spec")
    _model(52).to(torch.bfloat16).save_pretrained(tmp / "mx_bf16")
    write_release(tmp / "mx_bf16", tmp / "mx_src", tmp / "mx_dequantized")
    ckpt("convert", tmp / "mx_src", tmp / "mx", "--to", "torch_dist", "--tp", "2",
         "--local-spec", "--dtype", "fp32")
    args = open_checkpoint(tmp / "oss").common()["args"]
    load = dict(mode="load", tp=2, ep=2, config=_config(args), vocab=args.padded_vocab_size,
                vocab_out=args.vocab_size, seq=args.seq_length, mtp=False, tokens=TOKENS)
    jobs = [dict(load, name="oss", ckpt=str(tmp / "oss"), out=str(tmp / "oss.pt")),
            dict(SAVE, ckpt=str(tmp / "oss_save"), out=str(tmp / "oss_save.pt")),
            dict(load, name="mx", ckpt=str(tmp / "mx"), out=str(tmp / "mx.pt"))]
    (tmp / "spec.json").write_text(json.dumps({"jobs": jobs}))
    torchrun(str(WORKER), 4, str(tmp / "spec.json"), timeout=900)
    return tmp


def test_hf_to_torch_dist_gives_transformers_logits(runs):
    torch.testing.assert_close(torch.load(runs / "oss.pt"), _logits(runs / "oss_src"),
                               rtol=1e-4, atol=1e-5)


def test_import_args_are_megatron_lm_names(runs):
    args = vars(open_checkpoint(runs / "oss").common()["args"])
    assert args["softmax_type"] == "learnable" and args["window_size"] == (3, 0)
    assert args["window_attn_skip_freq"] == [1, 0] and args["quick_geglu"] is True
    assert args["activation_func_clamp_value"] == 7.0 and args["glu_linear_offset"] == 1.0
    assert args["position_embedding_type"] == "yarn"
    keys = open_checkpoint(runs / "oss").metadata().tensors
    assert keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"].shape == (4, 64, 64)
    assert keys["decoder.layers.0.mlp.experts.experts.linear_fc2.weight"].shape == (4, 64, 32)


def test_megatron_save_to_hf_gives_megatron_logits(runs):
    out = runs / "oss_save_hf"
    ckpt("convert", runs / "oss_save", out, "--to", "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["sliding_window"] == 4
    torch.testing.assert_close(_logits(out), torch.load(runs / "oss_save.pt"), rtol=1e-4,
                               atol=1e-5)


def test_transposed_down_proj_is_caught(runs, tmp_path):
    """The orientation trap: ``down_proj`` [E, F, hidden] written as Megatron-Core stores
    ``linear_fc2`` ([E, hidden, F]; square here, so shapes cannot tell) computes other logits."""
    from safetensors.torch import load_file, save_file

    out = runs / "oss_save_hf"
    if not out.exists():
        ckpt("convert", runs / "oss_save", out, "--to", "hf")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in out.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    sd = {}
    for f in out.glob("*.safetensors"):
        sd.update(load_file(f))
    for k in [k for k in sd if k.endswith("mlp.experts.down_proj")]:
        e, f_, h = sd[k].shape
        sd[k] = sd[k].transpose(1, 2).reshape(e, f_, h).contiguous()
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").unlink(missing_ok=True)
    diff = (_logits(bad) - torch.load(runs / "oss_save.pt")).abs().max()
    assert diff > 1e-2


def test_round_trip_is_bit_exact(runs):
    back = runs / "oss_back"
    ckpt("convert", runs / "oss", back, "--to", "hf")
    src, got = tensors(runs / "oss_src"), tensors(back)
    assert got.keys() == src.keys()
    for k in src:
        assert torch.equal(got[k], src[k]), k


def test_config_contradicting_the_weights_is_refused(runs, tmp_path):
    bad = tmp_path / "bad.json"
    config = json.loads((runs / "oss_src" / "config.json").read_text())
    bad.write_text(json.dumps({**config, "head_dim": 8}))
    out = _refused(runs / "oss_src", tmp_path / "mc", "--to", "torch_dist", "--hf-config",
                   str(bad))
    assert "q_proj" in out


def test_mxfp4_release_imports_as_its_dequantized_bf16_model_bit_exact(runs):
    from safetensors.torch import load_file

    stored = load_file(str(runs / "mx_src" / "model.safetensors"))
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 64, 2, 16)
    assert stored["model.layers.0.mlp.experts.down_proj_scales"].shape == (4, 64, 1)
    plain = tensors(runs / "mx_bf16")
    deq = tensors(runs / "mx_dequantized")
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(deq[key], plain[key])  # the experts really went through MXFP4
    for name in ("mx_src", "mx_dequantized"):
        ckpt("convert", runs / name, runs / f"{name}_bf16", "--to", "torch_dist", "--tp", "2",
             "--local-spec")
    got, want = tensors(runs / "mx_src_bf16"), tensors(runs / "mx_dequantized_bf16")
    assert got.keys() == want.keys() and len(got) == 29
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)), k
    a, b = (open_checkpoint(runs / n).common()["args"] for n in ("mx_src_bf16",
                                                                  "mx_dequantized_bf16"))
    assert vars(a) == vars(b)


def test_mxfp4_release_gives_transformers_logits(runs):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        runs / "mx_src", dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    with torch.no_grad():
        want = model(torch.tensor(TOKENS)).logits
    torch.testing.assert_close(torch.load(runs / "mx.pt"), want, rtol=1e-4, atol=1e-5)
    # not the unquantized model's logits: the MXFP4 values are what was computed
    assert (want - _logits(runs / "mx_bf16")).abs().max() > 1e-2
