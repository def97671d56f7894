"""Helpers shared by the Hugging Face logits tests (test_hf_logits*.py): the CLI, transformers'
logits, the Megatron-Core worker's job specs and the torchrun calls that run them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_hf_logits_worker.py"
TOKENS = [[1, 5, 7, 99, 3, 4, 20, 50, 11, 0], [2, 3, 4, 5, 6, 7, 8, 9, 98, 97]]
COMMON = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
# a checkpoint the real Megatron-Core saves (worker ``save`` mode); jobs override fields
SAVE_BASE = dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, ffn=128,
                 padded_vocab=128, vocab=100, seq=64, eps=1e-6, theta=10000.0, tied=False,
                 qkv_bias=False, qk_norm=False, dtype="float32", mode="save", tokens=TOKENS)
runner = CliRunner()


def ckpt(*argv: object) -> None:
    """``ckpt ARGV --no-progress``; fails the test unless it exits 0."""
    result = runner.invoke(app, [*map(str, argv), "--no-progress"])
    assert result.exit_code == 0, result.output


def hf_logits(path: Path) -> torch.Tensor:
    """transformers' fp32 logits for ``TOKENS`` from the HF directory ``path``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def assert_export_logits(tmp: Path, job: str, arch: str, *opts: str, name: str = "hf") -> None:
    """``convert tmp/<job> tmp/<job>_<name> --to hf OPTS`` writes an ``arch`` model whose
    transformers logits are the Megatron-Core worker's (``tmp/<job>.pt``)."""
    out = tmp / f"{job}_{name}"
    ckpt("convert", tmp / job, out, "--to", "hf", *opts)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    torch.testing.assert_close(hf_logits(out), torch.load(tmp / f"{job}.pt"), rtol=1e-4,
                               atol=1e-5)


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k) for k in r.metadata().tensors}


def randomise(model) -> None:
    """Norm weights, biases and routers away from their neutral init: mistakes must show."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name or ".ln_" in name  # GPT-2: ln_1, ln_2, ln_f
            if norm and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias") or "gate.weight" in name:
                p.normal_(0, 0.5)


def saved_models(tmp: Path, make_models, seed: int) -> dict[str, Path]:
    """``make_models()``'s HF models, built after ``torch.manual_seed(seed)``, randomised and
    saved as ``tmp/<name>``; returns those directories by name."""
    torch.manual_seed(seed)
    srcs = {}
    for name, model in make_models().items():
        randomise(model)
        srcs[name] = tmp / name
        model.save_pretrained(srcs[name])
    return srcs


def import_job(tmp: Path, job: str, **kw) -> dict:
    """The worker's ``load`` job (logits into ``tmp/<job>.pt``) for the conversion written to
    ``tmp/<job>``, at the layout its ``args`` give; ``kw`` overrides fields."""
    out = tmp / job
    args = open_checkpoint(out).common()["args"]
    if isinstance(args, dict):  # the legacy reader gives the fields as a dict
        args = argparse.Namespace(**args)
    return job_from_args(args, out, name=job, out=str(tmp / f"{job}.pt"),
                         tp=args.tensor_model_parallel_size,
                         pp=args.pipeline_model_parallel_size, **kw)


def save_jobs(tmp: Path, exports) -> list[dict]:
    """The worker's ``save`` jobs of ``(job, tp, pp, HF class, fields)`` rows: checkpoints the
    real Megatron-Core saves as ``tmp/<job>``, their logits in ``tmp/<job>.pt``."""
    return [dict(SAVE_BASE, name=job, ckpt=str(tmp / job), out=str(tmp / f"{job}.pt"),
                 tp=tp, pp=pp, **model) for job, tp, pp, _, model in exports]


def job_from_args(args, ckpt_dir: Path, **kw) -> dict:
    """The worker's model spec, from the ``args`` a conversion wrote (not from the HF
    config: the Megatron-Core model is built as Megatron-LM would build it from them)."""
    moe = {}
    if args.num_experts:
        moe = dict(experts=args.num_experts, topk=args.moe_router_topk,
                   moe_ffn=args.moe_ffn_hidden_size,
                   shared_ffn=args.moe_shared_expert_intermediate_size,
                   pre_softmax=args.moe_router_pre_softmax)
    if getattr(args, "position_embedding_type", "rope") == "learned_absolute":
        moe["arch"] = "gpt2"
    job = dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
               groups=args.num_query_groups, head_dim=args.kv_channels,
               ffn=args.ffn_hidden_size, padded_vocab=args.padded_vocab_size,
               vocab=args.vocab_size, seq=args.seq_length, eps=args.norm_epsilon,
               theta=args.rotary_base, tied=not args.untie_embeddings_and_output_weights,
               qkv_bias=args.add_qkv_bias, qk_norm=args.qk_layernorm, dtype="float32",
               mode="load", ckpt=str(ckpt_dir), tokens=TOKENS, **moe)
    return {**job, **kw}


def run_jobs(tmp: Path, jobs: list[dict]) -> None:
    """Every job in two torchruns (2 and 4 ranks): every rank costs CPU on every job, so a
    job that needs fewer ranks than its run has runs with data-parallel replicas."""
    for ranks in (2, 4):
        group = [j for j in jobs if max(2, j["tp"] * j["pp"]) == ranks]
        if group:
            (tmp / f"spec{ranks}.json").write_text(json.dumps({"jobs": group}))
            torchrun(str(WORKER), ranks, str(tmp / f"spec{ranks}.json"), timeout=900)


def assert_same_extra_state_objects(ours: Path, theirs: Path, count: int) -> set[str]:
    """The ``_extra_state`` objects of our conversion ``ours`` are those of the checkpoint the
    real Megatron-Core saved (``theirs``, a model of the same structure), ``count`` of them,
    each stored byte for byte alike; returns their unique keys."""
    with open_checkpoint(ours) as a, open_checkpoint(theirs) as b:
        keys = {o.unique_key for o in a.metadata().objects}
        want = {o.unique_key for o in b.metadata().objects
                if o.key.endswith("._extra_state")}
        assert keys == want and len(want) == count
        for key in want:
            assert a.stored_object_bytes(key) == b.stored_object_bytes(key), key
    return keys
