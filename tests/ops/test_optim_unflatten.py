"""The DistributedOptimizer's dp_reshardable (per-bucket) state of checkpoints written by the real
Megatron-Core 0.16.1, rebuilt in model space: the layout is proven against what is stored, and
every fp32 main parameter rounds exactly to the bf16 model parameter the same optimizer step
produced (a parameter read from the wrong bucket slot cannot)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ckpt_tool.errors import UnsupportedError
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.ops._optim_unflatten import UnflattenedOptimizerView, unflatten_bucketed_optimizer
from ckpt_tool.ops.reshard import ReshardRequest, reshard
from ckpt_tool.planning.feasibility import model_sizes_from
from ckpt_tool.planning.optim_buckets import optimizer_bucket_layout, prove_bucket_layout
from ckpt_tool.planning.source_layout import args_of, source_layout_from

FIX = Path(__file__).resolve().parents[2] / "fixtures"
BUCKETED = ["mcore016_gpt_tp2dp2_distopt_buckets", "mcore016_gpt_pp2dp2_distopt_buckets"]
GATHERED = "mcore016_gpt_tp2dp2_distopt_dpzero"


@pytest.mark.parametrize("fixture", BUCKETED + [GATHERED])
def test_main_params_round_to_the_model_and_moments_are_trained(fixture):
    view = unflatten_bucketed_optimizer(open_checkpoint(FIX / fixture))
    assert isinstance(view, UnflattenedOptimizerView)
    meta = view.metadata()
    assert meta.extras["optimizer_sharding"]["type"] == "fully_reshardable"
    assert not any(k.startswith("optimizer.distributed.") for k in meta.tensors)
    model_keys = [k for k in meta.tensors if not k.startswith("optimizer.")]
    assert model_keys
    for key in model_keys:
        main = view.read(f"optimizer.state.param.{key}")
        assert main.dtype == torch.float32
        assert torch.equal(main.bfloat16(), view.read(key)), key
        assert view.read(f"optimizer.state.exp_avg.{key}").abs().sum() > 0, key
        sq = view.read(f"optimizer.state.exp_avg_sq.{key}")
        assert (sq >= 0).all() and sq.sum() > 0, key
    common = view.common()
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert len(common["optimizer"]["optimizer"]["param_groups"]) == 2


def _layout(fixture):
    reader = open_checkpoint(FIX / fixture)
    meta, common = reader.metadata(), reader.common()
    per = {}
    for o in meta.objects:
        for i, name in enumerate(("per_bucket_numel", "per_bucket_numel_unpadded")):
            if o.key.endswith("." + name):
                idx = int(o.key.split("dp_group_idx_")[1].split(".")[0])
                per.setdefault(idx, [None, None])[i] = reader.read_object(o.unique_key)
    args = args_of(meta, common)
    return meta, model_sizes_from(meta, common), source_layout_from(meta, common), args, per


def test_the_proof_rejects_a_wrong_layout():
    meta, sizes, source, args, per = _layout(BUCKETED[0])
    buckets = optimizer_bucket_layout(meta, sizes, source, args)
    assert len(buckets) == 8 and prove_bucket_layout(buckets, meta, per, 2) == []
    # Transformer-Engine parameter order: same sizes, other boundaries -> refused
    te = optimizer_bucket_layout(meta, sizes, source, args, spec="transformer_engine")
    assert "stored per_bucket_numel" in prove_bucket_layout(te, meta, per, 2)[0]
    # another bucket size: other buckets -> refused
    other = optimizer_bucket_layout(meta, sizes, source, {**args, "ddp_bucket_size": 30000})
    assert prove_bucket_layout(other, meta, per, 2)
    # a missing per_bucket_numel object -> refused
    assert "per_bucket_numel is missing" in prove_bucket_layout(
        buckets, meta, {0: per[0]}, 2)[0]
    # a piece boundary that does not match (same numels) -> refused
    b = buckets[1]
    b.params[1] = replace(b.params[1], start=b.params[1].start + 64)
    assert any("first difference" in p for p in prove_bucket_layout(buckets, meta, per, 2))


def test_reshard_refuses_an_unproven_layout_with_one_line(tmp_path, monkeypatch):
    import ckpt_tool.ops._optim_unflatten as U

    real = U.optimizer_bucket_layout
    monkeypatch.setattr(U, "optimizer_bucket_layout",
                        lambda *a, **k: real(*a, **{**k, "spec": "transformer_engine"}))
    with pytest.raises(UnsupportedError, match="does not match the checkpoint") as e:
        reshard(FIX / BUCKETED[0], tmp_path / "out", ReshardRequest(tp=1))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    # --drop-optimizer needs no layout
    reshard(FIX / BUCKETED[0], tmp_path / "out", ReshardRequest(tp=1, drop_optimizer=True))
    meta = open_checkpoint(tmp_path / "out").metadata()
    assert not any(k.startswith("optimizer.") for k in meta.tensors)


def test_reshard_output_holds_model_space_state(tmp_path):
    out = tmp_path / "out"
    reshard(FIX / BUCKETED[1], out, ReshardRequest(tp=2, pp=1))
    reader = open_checkpoint(out)
    meta = reader.metadata()
    assert meta.extras["optimizer_sharding"]["type"] == "fully_reshardable"
    assert reader.common()["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    key = "decoder.layers.mlp.linear_fc1.weight"
    assert torch.equal(reader.read(f"optimizer.state.param.{key}").bfloat16(), reader.read(key))


def test_gathered_state_is_proven_against_the_model(monkeypatch):
    """dp_zero_gather_scatter has no per-piece chunks to prove against: the layout must give the
    stored buffer length and every main parameter must round to its model parameter."""
    import ckpt_tool.ops._optim_unflatten as U

    view = unflatten_bucketed_optimizer(open_checkpoint(FIX / GATHERED))
    assert "dp_zero_gather_scatter: 8 buckets" in view.metadata().extras["optimizer_sharding"][
        "source"]
    real = U.optimizer_bucket_layout
    monkeypatch.setattr(U, "optimizer_bucket_layout",
                        lambda *a, **k: real(*a, **{**k, "spec": "transformer_engine"}))
    with pytest.raises(UnsupportedError, match="does not round to|rebuilt buffer"):
        unflatten_bucketed_optimizer(open_checkpoint(FIX / GATHERED))
