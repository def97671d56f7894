"""Hugging Face interop proven by logits, for the architectures and layouts
test_hf_interop.py leaves out; the Megatron-Core jobs run in two ``torchrun`` calls (2 and 4
gloo ranks).

* HF -> ``convert --to torch_dist`` -> the real Megatron-Core GPTModel (local spec, CPU),
  built from the ``args`` the conversion wrote, loads it with its own sharded state dict and
  gives transformers' logits: Mistral (tied) at TP2 and at PP2, Qwen3 (q/k norm, head_dim
  != hidden / heads) at TP2, Mixtral (router, experts) at TP2, Qwen3-MoE (q/k norm,
  ``norm_topk_prob``) at TP1, Llama at TP2 x PP2 (each stage its own GPTModel, hidden
  states sent from stage to stage).
* Megatron-Core checkpoints saved by the real library -> ``convert --to hf`` (architecture
  guessed from ``args``) -> transformers gives the Megatron logits, at TP2: Mixtral-style MoE,
  Qwen2-MoE-style (shared expert and its gate, softmax before top-k, QKV bias), Qwen3-MoE-
  and Qwen3-style (q/k norm, head_dim != hidden / heads), GPT-2-style (LayerNorm, biases,
  learned positions); a tied Llama at PP2, an untied one at TP2 x PP2 (also as Mistral).
* bf16 stays bf16: a bf16 transformers MoE -> torch_dist -> HF is bit-exact, dtype kept.
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
COMMON = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def ckpt(*argv: object) -> None:
    result = runner.invoke(app, [*map(str, argv), "--no-progress"])
    assert result.exit_code == 0, result.output


def hf_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k) for k in r.metadata().tensors}


def randomise(model) -> None:
    """Norm weights, biases and routers away from their neutral init: mistakes must show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias") or "gate.weight" in name:
                p.normal_(0, 0.5)


def job_from_args(args, ckpt_dir: Path, **kw) -> dict:
    """The worker's model spec, from the ``args`` a conversion wrote (not from the HF
    config: the Megatron-Core model is built as Megatron-LM would build it from them)."""
    moe = {}
    if args.num_experts:
        moe = dict(experts=args.num_experts, topk=args.moe_router_topk,
                   moe_ffn=args.moe_ffn_hidden_size,
                   shared_ffn=args.moe_shared_expert_intermediate_size,
                   pre_softmax=args.moe_router_pre_softmax)
    return dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                groups=args.num_query_groups, head_dim=args.kv_channels,
                ffn=args.ffn_hidden_size, padded_vocab=args.padded_vocab_size,
                vocab=args.vocab_size, seq=args.seq_length, eps=args.norm_epsilon,
                theta=args.rotary_base, tied=not args.untie_embeddings_and_output_weights,
                qkv_bias=args.add_qkv_bias, qk_norm=args.qk_layernorm, dtype="float32",
                mode="load", ckpt=str(ckpt_dir), tokens=TOKENS, **moe, **kw)


def _hf_models() -> dict[str, object]:
    t = transformers
    return {
        "mistral": t.MistralForCausalLM(t.MistralConfig(
            intermediate_size=128, num_hidden_layers=2, head_dim=16, sliding_window=64,
            tie_word_embeddings=True, **COMMON)),
        "qwen3": t.Qwen3ForCausalLM(t.Qwen3Config(
            intermediate_size=96, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
            **COMMON)),
        "mixtral": t.MixtralForCausalLM(t.MixtralConfig(
            intermediate_size=64, num_hidden_layers=2, num_local_experts=4,
            num_experts_per_tok=2, tie_word_embeddings=False, **COMMON)),
        "qwen3_moe": t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
            tie_word_embeddings=False, **COMMON)),
        "llama": t.LlamaForCausalLM(t.LlamaConfig(
            intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=False, **COMMON)),
    }


# (job name, HF model, convert options)
IMPORTS = [("mistral_tp2", "mistral", ["--tp", "2"]),
           ("mistral_pp2", "mistral", ["--pp", "2"]),
           ("qwen3_tp2", "qwen3", ["--tp", "2"]),
           ("mixtral_tp2", "mixtral", ["--tp", "2", "--local-spec"]),
           ("qwen3_moe_tp1", "qwen3_moe", ["--local-spec"]),  # MoE: the norm names differ
           ("llama_tp2pp2", "llama", ["--tp", "2", "--pp", "2"])]
# (job name, tp, pp, model): checkpoints the real Megatron-Core saves
SAVE_BASE = dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=128,
                 padded_vocab=128, vocab=100, seq=64, eps=1e-6, theta=10000.0, tied=False,
                 qkv_bias=False, qk_norm=False, dtype="float32", mode="save", tokens=TOKENS)
EXPORTS = [("mixtral_save_tp2", 2, 1, "MixtralForCausalLM",
            dict(experts=4, topk=2, moe_ffn=32, shared_ffn=None, pre_softmax=False)),
           ("qwen2_moe_save_tp2", 2, 1, "Qwen2MoeForCausalLM",
            dict(experts=4, topk=2, moe_ffn=32, shared_ffn=48, pre_softmax=True,
                 qkv_bias=True)),
           ("qwen3_moe_save_tp2", 2, 1, "Qwen3MoeForCausalLM",
            dict(experts=4, topk=2, moe_ffn=32, shared_ffn=None, pre_softmax=False,
                 qk_norm=True, head_dim=32)),
           ("qwen3_save_tp2", 2, 1, "Qwen3ForCausalLM", dict(qk_norm=True, head_dim=32)),
           ("gpt2_save_tp2", 2, 1, "GPT2LMHeadModel",
            dict(arch="gpt2", groups=4, ffn=256, qkv_bias=True, tied=True, eps=1e-5)),
           ("llama_save_pp2", 1, 2, "LlamaForCausalLM", dict(layers=4, tied=True)),
           ("llama_save_tp2pp2", 2, 2, "LlamaForCausalLM", dict(layers=4))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Convert every HF model, then run every Megatron-Core job (load or save, logits)."""
    tmp = tmp_path_factory.mktemp("hf_logits")
    torch.manual_seed(14)
    srcs = {}
    for name, model in _hf_models().items():
        randomise(model)
        srcs[name] = tmp / name
        model.save_pretrained(srcs[name])
    jobs = []
    for job, model, opts in IMPORTS:
        out = tmp / job
        ckpt("convert", srcs[model], out, "--to", "torch_dist", *opts)
        args = open_checkpoint(out).common()["args"]
        jobs.append(job_from_args(args, out, name=job, out=str(tmp / f"{job}.pt"),
                                  tp=args.tensor_model_parallel_size,
                                  pp=args.pipeline_model_parallel_size))
    for job, tp, pp, _, model in EXPORTS:
        jobs.append(dict(SAVE_BASE, name=job, ckpt=str(tmp / job), out=str(tmp / f"{job}.pt"),
                         tp=tp, pp=pp, **model))
    # two torchruns: every rank costs CPU on every job; a job that needs fewer ranks than
    # its run has runs with data-parallel replicas
    for ranks in (2, 4):
        group = [j for j in jobs if max(2, j["tp"] * j["pp"]) == ranks]
        (tmp / f"spec{ranks}.json").write_text(json.dumps({"jobs": group}))
        torchrun(str(WORKER), ranks, str(tmp / f"spec{ranks}.json"), timeout=900)
    return tmp, srcs


@pytest.mark.parametrize("job,model,opts", IMPORTS, ids=[j[0] for j in IMPORTS])
def test_hf_to_torch_dist_gives_transformers_logits(runs, job, model, opts):
    tmp, srcs = runs
    got = torch.load(tmp / f"{job}.pt")
    torch.testing.assert_close(got, hf_logits(srcs[model]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("job,tp,pp,arch,model", EXPORTS, ids=[j[0] for j in EXPORTS])
def test_megatron_save_to_hf_gives_megatron_logits(runs, job, tp, pp, arch, model):
    tmp, _ = runs
    want = torch.load(tmp / f"{job}.pt")
    ckpt("convert", tmp / job, tmp / f"{job}_hf", "--to", "hf")
    config = json.loads((tmp / f"{job}_hf" / "config.json").read_text())
    assert config["architectures"] == [arch]  # guessed from the args
    torch.testing.assert_close(hf_logits(tmp / f"{job}_hf"), want, rtol=1e-4, atol=1e-5)
    if arch == "LlamaForCausalLM" and tp * pp == 4:  # the same weights as a Mistral
        ckpt("convert", tmp / job, tmp / f"{job}_mistral", "--to", "hf", "--hf-arch", "mistral")
        config = json.loads((tmp / f"{job}_mistral" / "config.json").read_text())
        assert config["architectures"] == ["MistralForCausalLM"]
        torch.testing.assert_close(hf_logits(tmp / f"{job}_mistral"), want, rtol=1e-4,
                                   atol=1e-5)


def test_bf16_transformers_moe_round_trip_keeps_dtype_bit_exact(tmp_path):
    torch.manual_seed(5)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, **COMMON))
    randomise(model)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    src = tensors(tmp_path / "src")
    assert {t.dtype for t in src.values()} == {torch.bfloat16}
    ckpt("convert", tmp_path / "src", tmp_path / "mc", "--to", "torch_dist", "--tp", "2",
         "--pp", "2")
    mc = open_checkpoint(tmp_path / "mc")
    assert {t.dtype for t in mc.metadata().tensors.values()} == {"bfloat16"}
    assert mc.common()["args"].bf16 is True
    ckpt("convert", tmp_path / "mc", tmp_path / "back", "--to", "hf")
    back = tensors(tmp_path / "back")
    assert back.keys() == src.keys()
    for k in src:
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], src[k]), k
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
