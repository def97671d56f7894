"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: Multi-Latent Attention, a dense layer then MoE layers
with a sigmoid router, expert bias, group-limited routing and shared experts, one MTP layer)
<-> Megatron-Core, proven by logits; the Megatron-Core jobs run in one ``torchrun`` of 4 gloo
ranks at TP2 x EP2 (``_hf_mla_worker.py``, ``fixtures/_mcore_mla.py``'s real model).

* transformers -> ``convert --to torch_dist --tp 2 --local-spec`` -> the real Megatron-Core
  model built from the ``args`` the conversion wrote, loaded as Megatron-LM loads (complete
  sharded state dict, default strictness) gives transformers' logits: the model as
  ``save_pretrained`` writes it (experts per expert) plus an MTP layer ``model.layers.3.*`` as
  DeepSeek's releases hold it; the same saved with transformers 5's fused experts
  (``save_original_format=False``); and a ``rope_interleave: false`` model (rotary rows in
  halves, interleaved on import).
* a checkpoint the real Megatron-Core saves (MTP, seeded expert biases) -> ``convert --to hf``
  (architecture from the args) -> transformers gives Megatron's logits, with the experts per
  expert (default) and fused (``--hf-experts fused``).
* the MoE fixture ``mcore016_deepseek_tp2ep2_distopt`` has a gated shared expert, which
  DeepSeek-V3 has no place for: refused by name, exit 2, nothing written; an HF config that
  contradicts the weights (``q_lora_rank``) too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _hf_jobs import ckpt, hf_logits, runner, tensors
from ckpt_tool.cli.app import app
from ckpt_tool.formats.base import open_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.multiproc, pytest.mark.slow]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_hf_mla_worker.py"
FIXTURE = REPO / "fixtures" / "mcore016_deepseek_tp2ep2_distopt"
TOKENS = [[1, 5, 7, 99, 3, 4, 20, 50, 11, 0, 17, 2], [2, 3, 4, 5, 6, 7, 8, 9, 98, 97, 96, 1]]
MTP_LEAVES = {"enorm.weight": (64,), "hnorm.weight": (64,), "eh_proj.weight": (64, 128),
              "shared_head.norm.weight": (64,), "embed_tokens.weight": (100, 64),
              "shared_head.head.weight": (100, 64)}


def _config(interleave: bool = True):
    return transformers.DeepseekV3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
        rope_interleave=interleave)


def _model(seed: int, interleave: bool = True):
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(_config(interleave))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.5 * torch.randn_like(b))
    return model


def _add_mtp(path: Path) -> None:
    """An MTP layer after the last (``model.layers.3.*``), as DeepSeek's releases hold it: a
    decoder layer shaped like the last one, enorm/hnorm/eh_proj, shared_head and copies of the
    embedding and head."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(f)
    g = torch.Generator().manual_seed(9)
    for k in [k for k in sd if k.startswith("model.layers.2.")]:
        sd["model.layers.3." + k[len("model.layers.2."):]] = torch.randn(
            sd[k].shape, generator=g) * 0.1
    for leaf, shape in MTP_LEAVES.items():
        sd["model.layers.3." + leaf] = torch.randn(shape, generator=g) * 0.1
    save_file(sd, f, metadata={"format": "pt"})


def _mla_config(args) -> dict:
    """The ``MLATransformerConfig`` fields Megatron-LM derives from these ``args``."""
    return dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                num_attention_heads=args.num_attention_heads,
                ffn_hidden_size=args.ffn_hidden_size, q_lora_rank=args.q_lora_rank,
                kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                rotary_base=args.rotary_base, rope_type=args.rope_type,
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
                moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor)


def _load_job(tmp: Path, name: str) -> dict:
    args = open_checkpoint(tmp / name).common()["args"]
    return dict(name=name, mode="load", ckpt=str(tmp / name), out=str(tmp / f"{name}.pt"),
                tp=args.tensor_model_parallel_size, ep=2, config=_mla_config(args),
                vocab=args.padded_vocab_size, vocab_out=args.vocab_size,
                seq=args.seq_length, mtp=bool(args.mtp_num_layers), tokens=TOKENS)


SAVE = dict(name="ds_save", mode="save", tp=2, ep=2, config={"moe_shared_expert_gate": False},
            args={"moe_shared_expert_gate": False}, vocab=128, vocab_out=128, seq=16,
            mtp=True, tokens=TOKENS, seed=5)
IMPORTS = {"ds": ([], True), "ds_fused": ([], True), "ds_halves": ([], False)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_deepseek")
    model = _model(21)
    model.save_pretrained(tmp / "ds_src")
    _add_mtp(tmp / "ds_src")
    model.save_pretrained(tmp / "ds_fused_src", save_original_format=False)
    _model(22, interleave=False).save_pretrained(tmp / "ds_halves_src")
    jobs = []
    for name in IMPORTS:
        ckpt("convert", tmp / f"{name}_src", tmp / name, "--to", "torch_dist", "--tp", "2",
             "--local-spec")
        jobs.append(_load_job(tmp, name))
    jobs.append(dict(SAVE, ckpt=str(tmp / "ds_save"), out=str(tmp / "ds_save.pt")))
    (tmp / "spec.json").write_text(json.dumps({"jobs": jobs}))
    torchrun(str(WORKER), 4, str(tmp / "spec.json"), timeout=900)
    return tmp


def _logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


@pytest.mark.parametrize("name", list(IMPORTS))
def test_hf_to_torch_dist_gives_transformers_logits(runs, name):
    got = torch.load(runs / f"{name}.pt")
    torch.testing.assert_close(got, _logits(runs / f"{name}_src"), rtol=1e-4, atol=1e-5)


def test_import_args_are_megatron_lm_names(runs):
    args = vars(open_checkpoint(runs / "ds").common()["args"])
    assert args["multi_latent_attention"] is True and args["q_lora_rank"] == 24
    assert args["moe_layer_freq"] == [0, 1, 1] and args["mtp_num_layers"] == 1
    assert args["moe_router_score_function"] == "sigmoid"
    assert args["moe_router_enable_expert_bias"] is True
    assert (args["moe_router_num_groups"], args["moe_router_group_topk"]) == (2, 1)
    assert args["moe_router_topk_scaling_factor"] == 2.5
    assert args["moe_shared_expert_intermediate_size"] == 16
    keys = open_checkpoint(runs / "ds").metadata().tensors
    assert keys["decoder.layers.1.mlp.router.expert_bias"].dtype == "float32"
    assert "mtp.layers.0.eh_proj.weight" in keys


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_megatron_save_to_hf_gives_megatron_logits(runs, layout):
    out = runs / f"ds_save_hf_{layout}"
    ckpt("convert", runs / "ds_save", out, "--to", "hf", "--hf-experts", layout)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    keys = tensors(out)
    fused = "model.layers.1.mlp.experts.gate_up_proj" in keys
    assert fused == (layout == "fused")
    assert "model.layers.3.eh_proj.weight" in keys  # the MTP layer, as DeepSeek's releases
    torch.testing.assert_close(_logits(out), torch.load(runs / "ds_save.pt"), rtol=1e-4,
                               atol=1e-5)


def test_round_trip_is_bit_exact_and_keeps_the_expert_layout(runs):
    for name in ("ds", "ds_fused"):
        back = runs / f"{name}_back"
        ckpt("convert", runs / name, back, "--to", "hf")
        src, got = tensors(runs / f"{name}_src"), tensors(back)
        # the MTP layer's copies of the embedding and head are written from the model's own
        extra = {k for k in got if k.endswith(("layers.3.embed_tokens.weight",
                                               "layers.3.shared_head.head.weight"))}
        assert got.keys() - extra == src.keys() - extra
        for k in src.keys() - extra:
            assert torch.equal(got[k], src[k]), k


def _refused(src: Path, out: Path, *argv: str) -> str:
    result = runner.invoke(app, ["convert", str(src), str(out), *argv, "--no-progress"])
    assert result.exit_code == 2, result.output
    assert not out.exists()
    assert len(result.output.strip().splitlines()) <= 2, result.output  # one line (+ hint)
    return result.output


def test_fixture_with_gated_shared_expert_is_refused_by_name(tmp_path):
    out = _refused(FIXTURE, tmp_path / "hf", "--to", "hf")
    assert "gated shared expert" in out or "shared_experts.gate_weight" in out


def test_config_contradicting_the_weights_is_refused(runs, tmp_path):
    bad = tmp_path / "bad.json"
    config = json.loads((runs / "ds_src" / "config.json").read_text())
    bad.write_text(json.dumps({**config, "q_lora_rank": 16}))
    out = _refused(runs / "ds_src", tmp_path / "mc", "--to", "torch_dist", "--hf-config",
                   str(bad))
    assert "q_a_proj" in out
