"""reshard: feasibility first, then outputs whose global tensors are the source's, bit for bit."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"
LEGACY = FIX / "megatron_legacy_tp2pp2"
OPTIM = FIX / "mcore016_gpt_tp2pp2_bf16_optim"
FLAT = FIX / "mcore015_gpt_flattened_optim"
runner = CliRunner()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k).clone() for k in r.metadata().tensors}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def test_chain_through_dist_and_legacy_ends_bit_identical(tmp_path):
    """TP2PP2 -> TP1PP1 (dist) -> TP4PP1 (legacy, vocab re-padded) -> TP2PP2 (dist)."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert reshard(DIST, a, ReshardRequest(tp=1, pp=1)).written
    rb = reshard(a, b, ReshardRequest(tp=4, pp=1, to="legacy"))
    assert any("padded vocab 128 -> 256" in p["reason"] for p in rb.plan["problems"])
    assert len(glob.glob(str(b / "iter_*" / "mp_rank_0?" / "model_optim_rng.pt"))) == 4
    rank0 = torch.load(glob.glob(str(b / "iter_*" / "mp_rank_00" / "*.pt"))[0],
                       weights_only=False)
    assert rank0["args"].tensor_model_parallel_size == 4
    assert rank0["args"].padded_vocab_size == 256
    assert rank0["model"]["embedding.word_embeddings.weight"].shape == (64, 64)
    # the fixture's args were written by hand (NullTokenizer of 128 in 128 rows: Megatron-LM
    # counts its end-of-document token, 129 rows); re-padded to 256 they read as Megatron-LM's
    # own, whose token 128 a reshard keeps (256 rows at tp 2) unless told the vocab
    kept = reshard(b, None, ReshardRequest(tp=2, pp=2, to="torch_dist"), check=True)
    assert kept.plan["args_updates"]["padded_vocab_size"] == 256
    reshard(b, c, ReshardRequest(tp=2, pp=2, to="torch_dist", vocab_size=128))
    _same(_tensors(DIST), _tensors(c))
    files = sorted(p.name for p in c.glob("iter_0000010/__*.distcp"))  # a save directory
    assert files == [f"__{r}_0.distcp" for r in range(4)]  # one file per target rank


def test_dist_chunks_follow_the_target_layout(tmp_path):
    reshard(DIST, tmp_path / "o", ReshardRequest(tp=4, pp=1))
    meta = open_checkpoint(tmp_path / "o").metadata()
    qkv = meta.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape == (4, 128, 64)
    assert sorted({c.sizes for c in qkv.chunks}) == [(1, 32, 64)]
    assert {c.file for c in qkv.chunks} == {f"__{r}_0.distcp" for r in range(4)}
    emb = meta.tensors["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64)  # re-padded for tp 4, new rows copy the last row
    with open_checkpoint(tmp_path / "o") as r, open_checkpoint(DIST) as s:
        e, src = r.read("embedding.word_embeddings.weight"), s.read(
            "embedding.word_embeddings.weight")
        assert torch.equal(e[:128], src) and torch.equal(e[128:], src[-1:].expand(128, -1))


def test_legacy_to_dist_has_megatron_core_names(tmp_path):
    reshard(LEGACY, tmp_path / "o", ReshardRequest(tp=2, pp=2, to="torch_dist"))
    got = _tensors(tmp_path / "o")
    _same(_tensors(DIST), got)  # the same global tensors as the real dist fixture


def test_legacy_same_layout_is_identity(tmp_path):
    reshard(LEGACY, tmp_path / "o", ReshardRequest(tp=2, pp=2))
    result = runner.invoke(app, ["diff", str(LEGACY), str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output


def test_optimizer_state_survives_a_tp_pp_change(tmp_path):
    reshard(OPTIM, tmp_path / "a", ReshardRequest(tp=1, pp=1))
    reshard(tmp_path / "a", tmp_path / "b", ReshardRequest(tp=2, pp=2))
    src, got = _tensors(OPTIM), _tensors(tmp_path / "b")
    assert any(k.startswith("optimizer.") for k in src)
    _same(src, got)


def test_flattened_optimizer_state_becomes_model_space(tmp_path):
    reshard(FLAT, tmp_path / "o", ReshardRequest(tp=1, pp=1))
    meta = open_checkpoint(tmp_path / "o").metadata()
    assert all(t.stored_shape is None for t in meta.tensors.values())
    # Megatron-Core 0.16's fully_reshardable names the fp32 main param "param" (0.15: fp32_param)
    renamed = {k.replace("optimizer.state.fp32_param.", "optimizer.state.param."): v
               for k, v in _tensors(FLAT).items()}
    assert sum(k.startswith("optimizer.state.param.") for k in renamed) == 16
    _same(renamed, _tensors(tmp_path / "o"))


def test_check_reports_every_problem_and_writes_nothing(tmp_path):
    result = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "o"), "--tp", "3",
                                 "--pp", "3", "--check", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    errors = [p for p in doc["problems"] if p["severity"] == "error"]
    reasons = " | ".join(p["reason"] for p in errors)
    assert "num_attention_heads (4)" in reasons and "ffn_hidden_size (128)" in reasons
    assert "4 layers" in reasons or "num_layers" in reasons
    assert all(p["fix"] for p in errors)
    assert not (tmp_path / "o").exists()
    assert "cannot reshard" in result.stderr


def test_dry_run_prints_per_rank_reads(tmp_path):
    result = runner.invoke(app, ["reshard", str(DIST), "--tp", "1", "--pp", "2",
                                 "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    for r in doc["ranks"]:
        assert r["reads"] and all(x["file"].endswith(".distcp") for x in r["reads"])
    stage0 = {x["file"] for x in doc["ranks"][0]["reads"]}
    assert stage0 == {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}


def test_dp_sharded_legacy_optimizer_needs_drop_optimizer(tmp_path):
    src = FIX / "megatron_legacy_distopt_tp2dp2"
    result = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--tp", "1"])
    assert result.exit_code == 1 and "drop-optimizer" in result.output
    result = runner.invoke(app, ["reshard", str(src), str(tmp_path / "o"), "--tp", "1",
                                 "--drop-optimizer"])
    assert result.exit_code == 0, result.output
    got = open_checkpoint(tmp_path / "o").metadata()
    assert got.tensors and not any(k.startswith("optimizer.") for k in got.tensors)


def test_cli_writes_and_validates(tmp_path):
    result = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "o"), "--tp", "1",
                                 "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["written"] and doc["target"] == str(tmp_path / "o")
    assert runner.invoke(app, ["validate", str(tmp_path / "o")]).exit_code == 0


def _te_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Local-spec legacy names -> the fused TE names dist checkpoints (and our legacy output
    from them) use."""
    return {k.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_"): v
            for k, v in tensors.items()}


def test_moe_with_experts_and_virtual_pipeline_through_dist(tmp_path):
    src = FIX / "megatron_legacy_moe_vpp"  # TP1 PP2 VPP2 EP2, 4 experts, shared expert
    reshard(src, tmp_path / "d", ReshardRequest(tp=1, pp=2, ep=2, to="torch_dist"))
    meta = open_checkpoint(tmp_path / "d").metadata()
    fc1 = meta.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape[:2] == (4, 4)  # Megatron-Core's SequentialMLP: (layer, global expert, ...)
    want = _tensors(src)  # args.transformer_impl is "local": local-spec names come back
    for layout in (dict(tp=1, pp=2, ep=2, vpp=2), dict(tp=2, pp=1, ep=4), dict(tp=1, pp=1)):
        out = tmp_path / f"l_{layout['tp']}_{layout['pp']}_{layout.get('ep', 1)}"
        reshard(tmp_path / "d", out, ReshardRequest(to="legacy", **layout))
        _same(want, _tensors(out))
    reshard(tmp_path / "d", tmp_path / "te", ReshardRequest(to="legacy", local_spec=False))
    _same(_te_names(want), _tensors(tmp_path / "te"))  # the override
    ranks = sorted(p.parent.name for p in (tmp_path / "l_2_1_4").glob("*/mp_rank_*/*.pt"))
    assert ranks == [f"mp_rank_{t:02d}_{e:03d}" for t in range(2) for e in range(4)]
    rank_file = next((tmp_path / "l_1_2_2").glob("*/mp_rank_00_001_001/*.pt"))
    state = torch.load(rank_file, weights_only=False)
    assert set(state) >= {"model0", "model1"}  # virtual pipeline chunks
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight" in state["model0"]


def test_workers_write_rank_files_in_parallel(tmp_path):
    reshard(OPTIM, tmp_path / "one", ReshardRequest(tp=4, pp=1))
    reshard(OPTIM, tmp_path / "many", ReshardRequest(tp=4, pp=1), workers=3)
    _same(_tensors(tmp_path / "one"), _tensors(tmp_path / "many"))
    assert sorted(p.name for p in (tmp_path / "many").glob("iter_*/*.distcp")) == \
        [f"__{r}_0.distcp" for r in range(4)]


def test_local_spec_names_reproduce_megatron_lm_local_files(tmp_path):
    """The dist fixture resharded to legacy TP2PP2 gives the legacy fixture (written from the
    same model with the local layer spec): every rank file, name and value, the linears'
    ``_extra_state`` entries (None) included. No --local-spec: the source's
    args.transformer_impl is "local"."""
    reshard(DIST, tmp_path / "o", ReshardRequest(tp=2, pp=2, to="legacy"))
    want = sorted(LEGACY.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    got = sorted((tmp_path / "o").glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    assert [p.parent.name for p in want] == [p.parent.name for p in got]
    for a, b in zip(want, got):
        x = torch.load(a, weights_only=False)["model"]
        y = torch.load(b, weights_only=False)["model"]
        assert set(x) == set(y), a
        assert all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] is y[k] is None
                   for k in x), a
