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
from ckpt_tool.planning.source_model import model_sizes_from
from ckpt_tool.planning.bucket_proof import prove_bucket_layout
from ckpt_tool.planning.optim_buckets import optimizer_bucket_layout
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


def test_reshard_refuses_an_unproven_layout_with_one_line(tmp_path):
    # the user's --te-spec on a local-spec model: the flag decides, the proof refuses it
    with pytest.raises(UnsupportedError, match="does not match the checkpoint") as e:
        reshard(FIX / BUCKETED[0], tmp_path / "out", ReshardRequest(tp=1, local_spec=False))
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    # --drop-optimizer needs no layout
    reshard(FIX / BUCKETED[0], tmp_path / "out", ReshardRequest(tp=1, drop_optimizer=True))
    meta = open_checkpoint(tmp_path / "out").metadata()
    assert not any(k.startswith("optimizer.") for k in meta.tensors)


def test_a_known_order_that_does_not_fit_gives_way_to_the_stored_data(tmp_path, monkeypatch):
    """Without a flag, a configuration whose layer spec's order fails the proof (a model of
    another family under the same key names, e.g. grouped-GEMM experts) is not the end: the
    order read off the stored data is proven instead, and says so."""
    import ckpt_tool.ops._optim_unflatten as U

    real = U.optimizer_bucket_layout
    monkeypatch.setattr(U, "optimizer_bucket_layout",
                        lambda *a, **k: real(*a, **{**k, "spec": "transformer_engine"}))
    result = reshard(FIX / BUCKETED[0], tmp_path / "out", ReshardRequest(tp=1))
    assert result.written
    assert any("parameter order read off the stored data" in p["reason"]
               for p in result.plan["problems"])


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


# --- MoE: the ChainedOptimizer's dense and expert buffers (expert parallel 2) ---------------
MOE = FIX / "mcore016_moe_ep2_distopt_buckets"
MOE_VPP = FIX / "mcore016_moe_pp2vpp2ep2_distopt_buckets"


def _dist_name(name):
    """(dist key, index) of a TP1/EP1 ``named_parameters`` name of the MoE fixture."""
    import re

    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name, ()
    layer, rest = int(m.group(1)), m.group(2)
    rest = rest.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
    rest = rest.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
    e = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
    if e:
        return f"decoder.layers.mlp.experts.experts.{e.group(2)}", (layer, int(e.group(1)))
    return f"decoder.layers.{rest}", (layer,)


@pytest.mark.parametrize("fixture,domains,buffers,params", [
    # EP2 at PP1: dense DP 4, expert DP 2
    (MOE, {("chained_0.", 0): 4, ("chained_1.", 0): 2, ("chained_1.", 1): 2}, 1, 38),
    # PP2 VPP2 EP2: dense DP 2, expert DP 1, one buffer per model chunk
    (MOE_VPP, {("chained_0.", 0): 2, ("chained_0.", 1): 2, **{("chained_1.", i): 1
                                                             for i in range(4)}}, 2, 72),
])
def test_moe_dense_and_expert_buckets_equal_the_real_optimizers_state(fixture, domains, buffers,
                                                                      params):
    """Every per-parameter fp32 main param / exp_avg / exp_avg_sq read through the view is
    bit-identical to what the real chained optimizers held (expected/optim.safetensors)."""
    from safetensors.torch import load_file

    view = unflatten_bucketed_optimizer(open_checkpoint(fixture))
    assert isinstance(view, UnflattenedOptimizerView)
    assert view.chained == ["chained_0.", "chained_1."]
    assert {b.domain: b.dp for b in view.buckets} == domains
    assert {b.gbuf_idx for b in view.buckets} == set(range(buffers))
    expected = load_file(fixture / "expected" / "optim.safetensors")
    assert len(expected) == 3 * params
    for k, want in expected.items():
        state, name = k.split(".", 1)
        key, idx = _dist_name(name)
        got = view.read(f"optimizer.state.{'param' if state == 'fp32_param' else state}.{key}")
        assert torch.equal(got[idx], want), k
    common = view.common()
    assert common["content_metadata"]["chained_optim_avoid_prefix"] is True
    assert sorted(common["optimizer"]) == [0, 1]
    groups = [common["optimizer"][i]["optimizer"]["param_groups"] for i in (0, 1)]
    assert {g["is_expert_parallel"] for g in groups[0]} == {False}
    assert {g["is_expert_parallel"] for g in groups[1]} == {True}


def test_moe_proof_rejects_a_wrong_expert_layout():
    meta, sizes, source, args, _ = _layout(MOE.name)
    reader = open_checkpoint(MOE)
    per = {}
    for o in meta.objects:
        for i, name in enumerate(("per_bucket_numel", "per_bucket_numel_unpadded")):
            if o.key.endswith("." + name):
                prefix = o.key.split("optimizer.distributed.")[0]
                idx = int(o.key.split("dp_group_idx_")[1].split(".")[0])
                per.setdefault((prefix, idx), [None, None])[i] = reader.read_object(o.unique_key)
    buckets = optimizer_bucket_layout(meta, sizes, source, args)
    assert prove_bucket_layout(buckets, meta, per, 4) == []
    # experts padded and split over the dense DP (4) instead of the expert DP (2) -> refused
    for b in buckets:
        if b.prefix == "chained_1.":
            b.dp = 4
    assert any("first difference" in p for p in prove_bucket_layout(buckets, meta, per, 4))
    # the expert optimizer's per_bucket_numel of one domain missing -> refused, named
    del per[("chained_1.", 1)]
    got = prove_bucket_layout(optimizer_bucket_layout(meta, sizes, source, args), meta, per, 4)
    assert got == ["chained_1.dp_group_idx_1: per_bucket_numel is missing"]


def _edited_copy(tmp_path, fixture, edit):
    """A copy of a fixture's dist checkpoint whose .metadata ``edit(metadata)`` changed."""
    import pickle
    import shutil

    out = Path(shutil.copytree(next((FIX / fixture).glob("iter_*")), tmp_path / "src"))
    with open(out / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fixture
    edit(md)
    with open(out / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return out


def _drop_keys(md, match):
    for k in [k for k in md.state_dict_metadata if match(k.split("/")[0])]:
        del md.state_dict_metadata[k]
    for i in [i for i in md.storage_data if match(i.fqn.split("/")[0])]:
        del md.storage_data[i]


def _rename_state(md, old, new):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for k in [k for k in md.state_dict_metadata if k.endswith("." + old)]:
        md.state_dict_metadata[k[:-len(old)] + new] = md.state_dict_metadata.pop(k)
    for i in [i for i in md.storage_data if i.fqn.endswith("." + old)]:
        md.storage_data[MetadataIndex(i.fqn[:-len(old)] + new, i.offset, i.index)] = \
            md.storage_data.pop(i)


@pytest.mark.parametrize("fixture", [BUCKETED[0], MOE.name])
@pytest.mark.parametrize("bad,needle", [
    ("no_per_bucket_numel", "per_bucket_numel is missing"),
    ("unknown_state", "optimizer state 'max_exp_avg_sq' in the per-bucket tensors"),
])
def test_bad_optimizer_state_is_refused_with_one_line(tmp_path, fixture, bad, needle):
    from typer.testing import CliRunner

    from ckpt_tool.cli.app import app

    if bad == "no_per_bucket_numel":
        src = _edited_copy(tmp_path, fixture, lambda md: _drop_keys(
            md, lambda k: k.endswith("dp_group_idx_0.per_bucket_numel")))
    else:
        src = _edited_copy(tmp_path, fixture,
                           lambda md: _rename_state(md, "exp_avg_sq", "max_exp_avg_sq"))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reshard", str(src), str(out), "--tp", "1", "--ep", "1"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), result.stderr
    assert needle in lines[0] and "Traceback" not in result.output
    assert not out.exists() and not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_unknown_declared_sharding_type_is_refused(tmp_path):
    import shutil

    src = Path(shutil.copytree(next(MOE.glob("iter_*")), tmp_path / "src"))
    common = torch.load(src / "common.pt", weights_only=False)
    common["content_metadata"]["distrib_optim_sharding_type"] = "bucket_space_v9"
    torch.save(common, src / "common.pt")
    with pytest.raises(UnsupportedError, match="'bucket_space_v9' is not a form Megatron-Core"):
        reshard(src, tmp_path / "out", ReshardRequest(ep=1))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fixture,args,needle", [
    (MOE_VPP, {"overlap_param_gather_with_optimizer_step": True},
     "one dense optimizer per model chunk is not rebuilt"),
    (MOE, {"context_parallel_size": 2}, "context parallelism"),
    (MOE, {"num_experts": 3}, "stacked experts, args.num_experts 3"),
])
def test_layouts_that_are_not_rebuilt_are_refused_by_name(fixture, args, needle):
    from ckpt_tool.planning.optim_buckets import BucketLayoutError

    meta, sizes, source, real, _ = _layout(fixture.name)
    sizes = sizes.with_(num_experts=args.get("num_experts", sizes.num_experts))
    with pytest.raises(BucketLayoutError, match=needle):
        optimizer_bucket_layout(meta, sizes, source, {**real, **args})


def test_one_optimizer_is_not_split_into_dense_and_expert_ones(monkeypatch):
    """A source whose experts sit in the dense optimizer (ep 1) holds no expert param groups:
    an ep > 1 target (two chained optimizers) is refused, not guessed."""
    from ckpt_tool.planning.sizes import Layout

    view = unflatten_bucketed_optimizer(open_checkpoint(MOE))
    common = view.common()
    assert view.common_for_target(common, Layout(ep=4)) is common
    assert view.common_for_target(common, Layout(ep=1))["optimizer"] is common["optimizer"][0]
    monkeypatch.setattr(UnflattenedOptimizerView, "chained", property(lambda self: []))
    with pytest.raises(UnsupportedError, match="expert optimizer's param groups"):
        view.common_for_target(view.common(), Layout(ep=2))


def test_cli_reshards_the_moe_buckets_to_ep1(tmp_path):
    """``ckpt reshard SRC DST --ep 1`` with no other flag: model-space state, one optimizer
    entry (the experts join the dense optimizer at ep 1), the content metadata selecting it."""
    from typer.testing import CliRunner

    from ckpt_tool.cli.app import app

    out = tmp_path / "ep1"
    result = CliRunner().invoke(app, ["reshard", str(MOE), str(out), "--ep", "1"])
    assert result.exit_code == 0, result.output
    # a reshard that goes through says what it did in notes on stderr
    assert "16 buckets" in " ".join(result.stderr.split())
    reader = open_checkpoint(out)
    meta, common = reader.metadata(), reader.common()
    assert not any(k.startswith("chained_") for k in meta.tensors)
    assert sorted(common["optimizer"]) == ["optimizer", "param_state_sharding_type"]
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common["args"].expert_model_parallel_size == 1
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert torch.equal(reader.read(f"optimizer.state.param.{key}").bfloat16(), reader.read(key))


def test_tied_embeddings_are_a_shared_bucket_only_in_a_pipeline():
    """DDP gives tied embeddings a bucket of their own ("shared_embedding") only at pp > 1,
    where the last stage registers its own copy as the output layer's weight (saved under the
    embedding's key: no output_layer.weight); at pp 1 tied embeddings change no bucket.
    (Proven against Megatron-LM's real saves in tests/peer/test_training_checkpointing.py.)"""
    from dataclasses import replace as copy_meta

    emb = "embedding.word_embeddings.weight"
    for fixture in BUCKETED:
        meta, sizes, source, args, _per = _layout(fixture)
        tied_meta = copy_meta(meta, tensors={k: t for k, t in meta.tensors.items()
                                             if not k.endswith("output_layer.weight")})
        untied = optimizer_bucket_layout(tied_meta, sizes, source, args)
        tied = optimizer_bucket_layout(
            tied_meta, sizes, source, {**args, "untie_embeddings_and_output_weights": False})
        if source.pp == 1:
            assert [[p.key for p in b.params] for b in tied] == \
                [[p.key for p in b.params] for b in untied]
            continue
        for b in tied:
            keys = [p.key for p in b.params]
            assert emb not in keys or keys == [emb], (b.pp_rank, b.bucket_idx, keys)
        holders = {(b.pp_rank, b.bucket_idx) for b in tied if [p.key for p in b.params] == [emb]}
        # stage 0's embedding is registered first (its buffer's last bucket), the last
        # stage's copy last (its first)
        last_of = {p: max(b.bucket_idx for b in tied if b.pp_rank == p and b.tp_rank == 0)
                   for p in range(source.pp)}
        assert (0, last_of[0]) in holders and (source.pp - 1, 0) in holders
