"""Hugging Face interop proven by logits for the layouts and names test_hf_logits.py leaves out:
Qwen2-MoE at TP2 (experts sharded, shared expert and its gate, router), pipeline-parallel GPT-2
and MoE models, the Transformer-Engine layer spec's norm names, and ``--to legacy``.

How the real Megatron-Core is run (``_hf_logits_worker.py``, two ``torchrun`` calls, 2 and 4
gloo ranks, CPU): each rank builds its own GPTModel from the ``args`` the conversion wrote.
With PP2 each rank holds one pipeline stage (``pre_process`` on the first, ``post_process`` on
the last), loads its own stage's shard (``dist_checkpointing.load`` of that stage's own sharded
state dict, or its own legacy rank file), and the stages are chained as Megatron's pipeline
schedule chains them: the first stage's output hidden states are sent to the next stage by a
plain gloo send/recv and given to it with ``set_input_tensor``. Tied embeddings at PP2 live in
both stages (the word embedding on the first, ``output_layer.weight`` on the last).

* HF -> ``convert --to torch_dist`` -> Megatron-Core gives transformers' logits: Qwen2-MoE at
  TP2 in the TE spec (see below), Qwen2-MoE at PP2 (local spec), GPT-2 at PP2 (TE spec: the
  fused LayerNorm's weight and bias, learned positions on the first stage, tied output layer
  on the last).
* HF -> ``convert --to legacy`` (Megatron-LM rank files) -> each rank loads its file's
  ``model`` with ``load_state_dict(strict=True)`` (no key missing, none unexpected) -> the
  logits: Llama at TP2 x PP2 (``--local-spec`` names), GPT-2 at PP2 (local spec, tied),
  Qwen2-MoE at PP2 (the default TE names, into the TE-spec model). (Not MoE legacy at TP2:
  the import writes ``expert_tensor_parallel_size`` 1, so experts stay whole in every TP rank's
  file, and this worker builds experts at ETP = TP.)
* Megatron-Core saves -> ``convert --to hf`` -> transformers gives the Megatron logits: GPT-2
  at PP2 (tied across stages), Qwen2-MoE at PP2 in the TE spec (its separate
  ``pre_mlp_layernorm``), Qwen2 (dense, QKV bias, tied) at PP2.

The TE spec: Transformer Engine needs CUDA and is not installed, so the model is built by
Megatron-Core's real ``get_gpt_layer_with_transformer_engine_spec`` over stand-in local modules
(``_te_standin.py``, with TE's ``_extra_state`` on every linear and norm). That proves the
TE layout's key set (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``/
``_bias`` for dense layers, ``pre_mlp_layernorm.weight`` for MoE layers) and its
``_extra_state`` objects load completely, as Megatron-LM loads (the complete sharded state
dict at the default strictness; legacy files with a strict ``load_state_dict``), and compute
the right function; it does not prove TE's kernels or FP8.
"""

from __future__ import annotations

import pytest
import torch

from _hf_jobs import (COMMON, assert_export_logits, assert_same_extra_state_objects, ckpt,
                      hf_logits, import_job, run_jobs, save_jobs, saved_models)
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")


def _hf_models() -> dict[str, object]:
    t = transformers
    return {
        "qwen2_moe": t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
            tie_word_embeddings=False, **COMMON)),
        "gpt2": t.GPT2LMHeadModel(t.GPT2Config(
            vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            activation_function="gelu", bos_token_id=0, eos_token_id=0)),
        "llama": t.LlamaForCausalLM(t.LlamaConfig(
            intermediate_size=128, num_hidden_layers=4, tie_word_embeddings=False, **COMMON)),
    }


# (job name, HF model, convert options, worker options)
IMPORTS = [
    ("qwen2_moe_tp2_te", "qwen2_moe", ["--to", "torch_dist", "--tp", "2"], {"spec": "te"}),
    ("qwen2_moe_pp2", "qwen2_moe", ["--to", "torch_dist", "--pp", "2", "--local-spec"], {}),
    ("gpt2_pp2_te", "gpt2", ["--to", "torch_dist", "--pp", "2"], {"spec": "te"}),
    ("llama_legacy_tp2pp2", "llama",
     ["--to", "legacy", "--tp", "2", "--pp", "2", "--local-spec"], {"mode": "legacy"}),
    ("gpt2_legacy_pp2", "gpt2", ["--to", "legacy", "--pp", "2", "--local-spec"],
     {"mode": "legacy"}),
    ("qwen2_moe_legacy_pp2_te", "qwen2_moe", ["--to", "legacy", "--pp", "2"],
     {"mode": "legacy", "spec": "te"}),
]
# (job name, tp, pp, HF architecture guessed from the args, model): the real library saves
EXPORTS = [
    ("gpt2_save_pp2", 1, 2, "GPT2LMHeadModel",
     dict(arch="gpt2", groups=4, ffn=256, qkv_bias=True, tied=True, eps=1e-5)),
    ("qwen2_moe_save_pp2_te", 1, 2, "Qwen2MoeForCausalLM",
     dict(experts=4, topk=2, moe_ffn=32, shared_ffn=48, pre_softmax=True, qkv_bias=True,
          spec="te")),
    ("qwen2_save_pp2", 1, 2, "Qwen2ForCausalLM", dict(qkv_bias=True, tied=True)),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Convert every HF model, then run every Megatron-Core job (load or save, logits)."""
    tmp = tmp_path_factory.mktemp("hf_logits_layouts")
    srcs = saved_models(tmp, _hf_models, seed=141)
    jobs = []
    for job, model, opts, worker in IMPORTS:
        ckpt("convert", srcs[model], tmp / job, *opts)
        jobs.append(import_job(tmp, job, **worker))
    run_jobs(tmp, jobs + save_jobs(tmp, EXPORTS))
    return tmp, srcs


@pytest.mark.parametrize("job,model,opts,worker", IMPORTS, ids=[j[0] for j in IMPORTS])
def test_hf_import_gives_transformers_logits(runs, job, model, opts, worker):
    tmp, srcs = runs
    got = torch.load(tmp / f"{job}.pt")
    torch.testing.assert_close(got, hf_logits(srcs[model]), rtol=1e-4, atol=1e-5)


def test_te_names_are_the_te_specs(runs):
    """The default import writes the TE spec's norm names: fused into ``linear_qkv`` and (dense)
    ``linear_fc1``, a separate ``pre_mlp_layernorm`` before MoE experts; legacy files the
    same per layer. (That these load completely is the strict legacy load above.)"""
    tmp, _ = runs
    dense = open_checkpoint(tmp / "gpt2_pp2_te").metadata().tensors
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.self_attention.linear_qkv.layer_norm_bias",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_bias"} <= dense.keys()
    assert not [k for k in dense if "input_layernorm" in k or "pre_mlp_layernorm" in k]
    moe = open_checkpoint(tmp / "qwen2_moe_legacy_pp2_te").metadata().tensors
    assert {"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.0.pre_mlp_layernorm.weight"} <= moe.keys()
    assert not [k for k in moe if "input_layernorm" in k or "linear_fc1.layer_norm" in k]


def test_te_import_holds_the_extra_state_objects_megatron_core_saves(runs):
    """The TE-spec import of Qwen2-MoE holds exactly the ``_extra_state`` objects the real
    Megatron-Core saves from a TE-spec Qwen2-MoE of the same structure (2 layers, 4 experts,
    a shared expert; ``qwen2_moe_save_pp2_te``): the linears', the MoE layers' separate
    ``pre_mlp_layernorm``'s and the final norm's, each stored byte for byte alike (TE's empty
    ``uint8`` tensor)."""
    tmp, _ = runs
    keys = assert_same_extra_state_objects(tmp / "qwen2_moe_tp2_te",
                                           tmp / "qwen2_moe_save_pp2_te", 2 * (5 + 2 * 4) + 1)
    assert "decoder.layers.pre_mlp_layernorm._extra_state/shard_1_2" in keys


@pytest.mark.parametrize("job,tp,pp,arch,model", EXPORTS, ids=[j[0] for j in EXPORTS])
def test_megatron_save_to_hf_gives_megatron_logits(runs, job, tp, pp, arch, model):
    tmp, _ = runs
    assert_export_logits(tmp, job, arch)  # the architecture guessed from the args
