"""Hugging Face interop against the real libraries, proven by logits.

* HF -> Megatron-Core: tiny random transformers models (Llama with GQA and untied embeddings,
  sharded safetensors; Qwen2 with QKV bias and tied embeddings) -> ``ckpt convert --to
  torch_dist [--tp 2]`` -> the real Megatron-Core GPTModel built on CPU (local spec, TP2 / TP1)
  loads it with ``dist_checkpointing.load`` and gives the transformers logits.
* Megatron-Core -> HF: a GPT checkpoint written by ``megatron.core.dist_checkpointing.save``
  at TP2 (tied embeddings, padded vocab) -> ``--to hf`` -> transformers gives its logits.
* Round trips are bit-exact (HF -> torch_dist -> HF, HF -> legacy TP2 -> HF, MCore -> HF ->
  torch_dist except the padded vocab rows, which export drops and import re-pads with zeros).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_hf_logits_worker.py"
TOKENS = [[1, 5, 7, 99, 3, 4, 20, 50, 11, 0], [2, 3, 4, 5, 6, 7, 8, 9, 98, 97]]
runner = CliRunner()


def ckpt(*argv: str) -> None:
    result = runner.invoke(app, [*map(str, argv), "--no-progress"])
    assert result.exit_code == 0, result.output


def hf_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def megatron_logits(tmp: Path, spec: dict, nproc: int) -> torch.Tensor:
    spec = {"tokens": TOKENS, "out": str(tmp / "logits.pt"), **spec}
    (tmp / "spec.json").write_text(json.dumps(spec))
    torchrun(str(WORKER), nproc, str(tmp / "spec.json"), timeout=600)
    return torch.load(tmp / "logits.pt")


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k) for k in r.metadata().tensors}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def spec_of(cfg, **kw) -> dict:
    return dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                heads=cfg.num_attention_heads, groups=cfg.num_key_value_heads,
                ffn=cfg.intermediate_size, vocab=cfg.vocab_size, seq=cfg.max_position_embeddings,
                eps=cfg.rms_norm_eps, theta=cfg.rope_parameters["rope_theta"],
                tied=cfg.tie_word_embeddings, qk_norm=False, dtype="float32", **kw)


def test_llama_hf_to_torch_dist_tp2_gives_transformers_logits(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    src = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src, max_shard_size="100KB")
    assert (src / "model.safetensors.index.json").is_file()  # sharded input
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist", "--tp", "2")
    got = megatron_logits(tmp_path, spec_of(cfg, padded_vocab=256, qkv_bias=False, mode="load",
                                            ckpt=str(tmp_path / "mcore")), 2)
    torch.testing.assert_close(got, hf_logits(src), rtol=1e-4, atol=1e-5)
    ckpt("convert", tmp_path / "mcore", tmp_path / "back", "--to", "hf",
         "--max-shard-size", "100KB")
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    assert_same(tensors(tmp_path / "back"), tensors(src))
    ckpt("convert", src, tmp_path / "legacy", "--to", "legacy", "--tp", "2", "--local-spec")
    assert (tmp_path / "legacy" / "release" / "mp_rank_01" / "model_optim_rng.pt").is_file() \
        or any((tmp_path / "legacy").glob("*/mp_rank_01/model_optim_rng.pt"))
    keys = open_checkpoint(tmp_path / "legacy").metadata().tensors
    assert "decoder.layers.1.input_layernorm.weight" in keys  # the local spec's norm names
    ckpt("convert", tmp_path / "legacy", tmp_path / "back2", "--to", "hf")
    assert_same(tensors(tmp_path / "back2"), tensors(src))


def test_mistral_sliding_window_carried_both_ways_gives_transformers_logits(tmp_path):
    """transformers' sliding_window W (keys i-W+1..i) is Megatron-Core's window_size (W-1, 0)
    (keys i-(W-1)..i): the same logits over 10 tokens with a window of 3."""
    torch.manual_seed(4)
    cfg = transformers.MistralConfig(vocab_size=100, hidden_size=32, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=3, tie_word_embeddings=False)
    src = tmp_path / "mistral"
    transformers.MistralForCausalLM(cfg).save_pretrained(src)
    want = hf_logits(src)
    wider = json.loads((src / "config.json").read_text()) | {"sliding_window": 4}
    (tmp_path / "wider").mkdir()
    for f in src.iterdir():
        (tmp_path / "wider" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "wider" / "config.json").write_text(json.dumps(wider))
    assert not torch.allclose(hf_logits(tmp_path / "wider"), want)  # the window matters here
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist")
    args = open_checkpoint(tmp_path / "mcore").common()["args"]
    assert args.window_size == (2, 0)
    got = megatron_logits(tmp_path, spec_of(cfg, padded_vocab=128, qkv_bias=False, mode="load",
                                            ckpt=str(tmp_path / "mcore"), window=[2, 0]), 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    ckpt("convert", tmp_path / "mcore", tmp_path / "back", "--to", "hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["sliding_window"] == 3
    assert_same(tensors(tmp_path / "back"), tensors(src))
    torch.testing.assert_close(hf_logits(tmp_path / "back"), want, rtol=0, atol=0)


def test_qwen2_qkv_bias_tied_hf_to_torch_dist_tp1(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    src = tmp_path / "qwen2"
    model.save_pretrained(src)
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist")
    got = megatron_logits(tmp_path, spec_of(cfg, padded_vocab=128, qkv_bias=True, mode="load",
                                            ckpt=str(tmp_path / "mcore")), 1)
    torch.testing.assert_close(got, hf_logits(src), rtol=1e-4, atol=1e-5)
    ckpt("convert", tmp_path / "mcore", tmp_path / "back", "--to", "hf")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == \
        ["Qwen2ForCausalLM"]
    assert_same(tensors(tmp_path / "back"), tensors(src))


def test_megatron_checkpoint_to_hf_gives_megatron_logits(tmp_path):
    spec = dict(layers=2, hidden=64, heads=4, groups=2, ffn=128, padded_vocab=128, vocab=100,
                seq=64, eps=1e-6, theta=10000.0, tied=True, qkv_bias=False, qk_norm=False,
                dtype="float32", mode="save", ckpt=str(tmp_path / "mcore"))
    want = megatron_logits(tmp_path, spec, 2)
    ckpt("convert", tmp_path / "mcore", tmp_path / "hf", "--to", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 100
    assert config["tie_word_embeddings"] is True
    torch.testing.assert_close(hf_logits(tmp_path / "hf"), want, rtol=1e-4, atol=1e-5)
    # back to torch_dist at the source's TP: bit-exact but for the padded vocab rows
    ckpt("convert", tmp_path / "hf", tmp_path / "again", "--to", "torch_dist", "--tp", "2",
         "--hf-config", tmp_path / "hf" / "config.json")
    orig, again = tensors(tmp_path / "mcore"), tensors(tmp_path / "again")
    emb = "embedding.word_embeddings.weight"
    assert torch.equal(again[emb][:100], orig[emb][:100]) and not again[emb][100:].any()
    assert_same({k: v for k, v in again.items() if k != emb},
                {k: v for k, v in orig.items() if k != emb})


def _tiny(arch: str):
    common = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    moe = dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
               num_experts_per_tok=2)
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0))
    if arch == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **common))
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            shared_expert_intermediate_size=40, **moe, **common))
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            head_dim=8, **moe, **common))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        intermediate_size=48, head_dim=8, **common))


@pytest.mark.parametrize("arch", ["qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2"])
def test_more_architectures_round_trip_bit_exact(tmp_path, arch):
    torch.manual_seed(3)
    src = tmp_path / arch
    _tiny(arch).save_pretrained(src)
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist")
    args = open_checkpoint(tmp_path / "mcore").common()["args"]
    assert args.hf_architecture == json.loads((src / "config.json").read_text())[
        "architectures"][0]
    if arch != "gpt2" and arch != "qwen3":
        assert args.num_experts == 4 and args.moe_router_topk == 2
        keys = open_checkpoint(tmp_path / "mcore").metadata().tensors
        assert keys["decoder.layers.mlp.experts.experts.linear_fc2.weight"].shape[:2] == (2, 4)
    ckpt("convert", tmp_path / "mcore", tmp_path / "back", "--to", "hf")
    assert_same(tensors(tmp_path / "back"), tensors(src))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == arch
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")  # loads, no missing


def test_qwen2_moe_hf_to_torch_dist_gives_transformers_logits(tmp_path):
    """Experts, router (softmax before top-k), shared expert and its gate, QKV bias."""
    torch.manual_seed(2)
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    model = transformers.Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():  # zero biases and a weak router would hide mistakes
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "gate.weight" in name:
                p.normal_(0, 0.5)
    src = tmp_path / "qwen2moe"
    model.save_pretrained(src)
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist", "--local-spec")
    spec = spec_of(cfg, padded_vocab=128, qkv_bias=True, mode="load",
                   ckpt=str(tmp_path / "mcore"), experts=4, topk=2, moe_ffn=24, shared_ffn=40,
                   pre_softmax=True)
    got = megatron_logits(tmp_path, spec, 1)
    torch.testing.assert_close(got, hf_logits(src), rtol=1e-4, atol=1e-5)


def test_gpt2_hf_to_torch_dist_tp2_gives_transformers_logits(tmp_path):
    """LayerNorm + biases, learned positions, Conv1D weights, c_attn regrouped per head."""
    torch.manual_seed(4)
    cfg = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  activation_function="gelu", bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    src = tmp_path / "gpt2"
    model.save_pretrained(src)
    ckpt("convert", src, tmp_path / "mcore", "--to", "torch_dist", "--tp", "2")
    spec = dict(arch="gpt2", layers=2, hidden=32, heads=4, groups=4, ffn=128, vocab=100,
                padded_vocab=256, seq=64, eps=cfg.layer_norm_epsilon, theta=10000.0, tied=True,
                qkv_bias=True, qk_norm=False, dtype="float32", mode="load",
                ckpt=str(tmp_path / "mcore"))
    got = megatron_logits(tmp_path, spec, 2)
    torch.testing.assert_close(got, hf_logits(src), rtol=1e-4, atol=1e-5)
