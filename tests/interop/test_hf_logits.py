"""Hugging Face interop proven by logits, for the architectures and layouts
test_hf_interop.py leaves out; the Megatron-Core jobs run in two ``torchrun`` calls (2 and 4
gloo ranks).

* HF -> ``convert --to torch_dist`` -> the real Megatron-Core GPTModel (local spec, CPU),
  built from the ``args`` the conversion wrote, loads it as Megatron-LM does (its complete
  sharded state dict, ``_extra_state`` objects included, at the default strictness) and
  gives transformers' logits: Mistral (tied) at TP2 and at PP2, Qwen3 (q/k norm, head_dim
  != hidden / heads) at TP2, Mixtral (router, experts) at TP2, Qwen3-MoE (q/k norm,
  ``norm_topk_prob``) at TP1, Llama at TP2 x PP2 (each stage its own GPTModel, hidden
  states sent from stage to stage). The Mistral PP2 import is ``--local-spec`` and its
  model is built as on a machine with Transformer Engine (``te_installed``): its final norm
  is then a ``TENorm``, whose ``_extra_state`` the checkpoint must hold too.
* Megatron-Core checkpoints saved by the real library -> ``convert --to hf`` (architecture
  guessed from ``args``) -> transformers gives the Megatron logits, at TP2: Mixtral-style MoE,
  Qwen2-MoE-style (shared expert and its gate, softmax before top-k, QKV bias), Qwen3-MoE-
  and Qwen3-style (q/k norm, head_dim != hidden / heads), GPT-2-style (LayerNorm, biases,
  learned positions); a tied Llama at PP2, an untied one at TP2 x PP2 (also as Mistral).
* bf16 stays bf16: a bf16 transformers MoE -> torch_dist -> HF is bit-exact, dtype kept.
"""

from __future__ import annotations

import json

import pytest
import torch

from _hf_jobs import (COMMON, assert_export_logits, assert_same_extra_state_objects, ckpt,
                      hf_logits, import_job, randomise, run_jobs, save_jobs, saved_models,
                      tensors)
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")


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
           ("mistral_pp2", "mistral", ["--pp", "2", "--local-spec"]),
           ("qwen3_tp2", "qwen3", ["--tp", "2"]),
           ("mixtral_tp2", "mixtral", ["--tp", "2", "--local-spec"]),
           ("qwen3_moe_tp1", "qwen3_moe", ["--local-spec"]),  # MoE: the norm names differ
           ("llama_tp2pp2", "llama", ["--tp", "2", "--pp", "2"])]
WORKER_OPTIONS = {"mistral_pp2": {"te_installed": True}}  # see the module docstring
# (job name, tp, pp, model): checkpoints the real Megatron-Core saves
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
    srcs = saved_models(tmp, _hf_models, seed=14)
    jobs = []
    for job, model, opts in IMPORTS:
        ckpt("convert", srcs[model], tmp / job, "--to", "torch_dist", *opts)
        jobs.append(import_job(tmp, job, **WORKER_OPTIONS.get(job, {})))
    run_jobs(tmp, jobs + save_jobs(tmp, EXPORTS))
    return tmp, srcs


@pytest.mark.parametrize("job,model,opts", IMPORTS, ids=[j[0] for j in IMPORTS])
def test_hf_to_torch_dist_gives_transformers_logits(runs, job, model, opts):
    tmp, srcs = runs
    got = torch.load(tmp / f"{job}.pt")
    torch.testing.assert_close(got, hf_logits(srcs[model]), rtol=1e-4, atol=1e-5)


def test_local_import_holds_the_extra_state_objects_megatron_core_saves(runs):
    """The ``--local-spec`` import of Mixtral holds exactly the ``_extra_state`` objects the
    real Megatron-Core saves from a local-spec Mixtral-style GPT of the same structure (2
    layers, 4 experts; ``mixtral_save_tp2``), each stored byte for byte alike (``None``)."""
    tmp, _ = runs
    assert_same_extra_state_objects(tmp / "mixtral_tp2", tmp / "mixtral_save_tp2",
                                    2 * (2 + 2 * 4))


@pytest.mark.parametrize("job,tp,pp,arch,model", EXPORTS, ids=[j[0] for j in EXPORTS])
def test_megatron_save_to_hf_gives_megatron_logits(runs, job, tp, pp, arch, model):
    tmp, _ = runs
    assert_export_logits(tmp, job, arch)  # the architecture guessed from the args
    if arch == "LlamaForCausalLM" and tp * pp == 4:  # the same weights as a Mistral
        assert_export_logits(tmp, job, "MistralForCausalLM", "--hf-arch", "mistral",
                             name="mistral")


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
