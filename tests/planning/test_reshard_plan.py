"""The reshard plan on the real fixtures: the identity plan reproduces Megatron-Core's chunk
grid and files; every piece's reads cover it; byte ranges of raw (legacy) chunks are exact;
flattened optimizer state is read whole; executing the plan's reads (with the reader) gives
each target rank's tensors, checked against the global tensors and the legacy rank files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, dtype_itemsize
from ckpt_tool.planning.reshard import ReshardOptions, plan_reshard
from ckpt_tool.planning.sizes import Layout

FP32 = "fixtures/mcore016_gpt_tp2pp2_fp32"
OPTIM = "fixtures/mcore016_gpt_tp2pp2_bf16_optim"
FLAT = "fixtures/mcore015_gpt_flattened_optim"
LEGACY = "fixtures/megatron_legacy_tp2pp2"


@pytest.fixture(scope="module")
def src():
    out = {}
    for f in (FP32, OPTIM, FLAT, LEGACY):
        r = open_checkpoint(f)
        out[f] = (r, r.metadata(), r.common() if f != LEGACY else None)
    return out


def _plan(src, f, target, **opts):
    r, meta, common = src[f]
    return plan_reshard(meta, target, options=ReshardOptions(**opts), common=common)


def _assert_reads_cover(plan):
    for rp in plan.ranks:
        for tp_ in rp.tensors:
            for pp_ in tp_.pieces:
                if pp_.piece.fill:
                    assert not pp_.reads
                    continue
                flat = [r for r in pp_.reads if r.flat_range is not None]
                if flat:
                    continue
                vol = sum(math.prod(r.region[1]) for r in pp_.reads)
                assert vol == math.prod(pp_.piece.sizes), (tp_.key, pp_.piece)


@pytest.mark.parametrize("f", [FP32, OPTIM])
def test_identity_plan_is_the_source_grid(src, f):
    _, meta, _ = src[f]
    plan = _plan(src, f, Layout(tp=2, pp=2))
    assert plan.ok and not plan.dropped
    for key, t in meta.tensors.items():
        want = sorted((c.offsets, c.sizes, c.file.split("_")[2]) for c in t.chunks)
        got = sorted((c.offsets, c.sizes, c.file.split("_")[2].split(".")[0])
                     for c in plan.target_meta.tensors[key].chunks)
        assert got == want, key
    for rp in plan.ranks:  # each rank reads exactly the chunks its source twin wrote
        files = {f for f, _, _ in rp.read_ranges()}
        assert files and all(f.startswith(f"__{rp.rank}_") for f in files)
    assert {o.unique_key for o in plan.target_meta.objects} == {
        o.unique_key for o in meta.objects}
    _assert_reads_cover(plan)


def test_tp1_reads_every_chunk_once(src):
    _, meta, _ = src[FP32]
    plan = _plan(src, FP32, Layout(tp=1, pp=1))
    assert plan.ok
    (rank,) = plan.ranks
    assert rank.file == "__0_0.distcp"
    every = {(c.file, c.byte_offset, c.byte_length) for t in meta.tensors.values()
             for c in t.chunks}
    assert set(rank.read_ranges()) == every
    fc1 = plan.target_meta.tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert len(fc1.chunks) == 8  # W and V halves per layer, as MCore stores them at tp=1
    assert plan.target_meta.tensors["embedding.word_embeddings.weight"].chunks == (
        ChunkRef((0, 0), (128, 64), file="__0_0.distcp"),)
    assert sorted(plan.dropped) == sorted(o.unique_key for o in meta.objects
                                          if o.key == "rng_state")
    _assert_reads_cover(plan)
    again = CheckpointMeta.from_dict(plan.target_meta.to_full_dict())
    assert again.tensors == plan.target_meta.tensors


def test_tp4_repads_vocab_and_splits_qkv(src):
    plan = _plan(src, FP32, Layout(tp=4, pp=1))
    assert plan.ok and plan.args_updates["padded_vocab_size"] == 256
    emb = plan.target_meta.tensors["embedding.word_embeddings.weight"]
    assert emb.shape == (256, 64) and [c.offsets[0] for c in emb.chunks] == [0, 64, 128, 192]
    by_rank = {rp.rank: rp for rp in plan.ranks}
    e3 = [t for t in by_rank[3].tensors if t.key == "embedding.word_embeddings.weight"]
    (piece,) = e3[0].pieces
    assert piece.piece.fill == "copy" and piece.piece.fill_row == 127 and not piece.reads
    qkv = [t for t in by_rank[1].tensors
           if t.key == "decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv) == 4 and all(t.local_shape == (1, 32, 64) for t in qkv)
    assert any(p.key == "vocab" for p in plan.problems)
    _assert_reads_cover(plan)


def test_legacy_source_reads_exact_raw_bytes(src):
    _, meta, _ = src[LEGACY]
    plan = _plan(src, LEGACY, Layout(tp=4, pp=1), target_format="legacy")
    assert plan.ok
    exact = 0
    for rp in plan.ranks:
        assert rp.file == f"mp_rank_{rp.tp:02d}/model_optim_rng.pt"
        for r in rp.reads():
            item = dtype_itemsize(meta.tensors[r.key].dtype)
            c = r.chunk
            assert c.byte_offset <= r.byte_offset
            assert r.byte_offset + r.byte_length <= c.byte_offset + c.byte_length
            contiguous = all(rs == cs for rs, cs in zip(r.region[1][1:], c.sizes[1:]))
            if contiguous:
                assert r.byte_length == math.prod(r.region[1]) * item, r
                exact += 1
    assert exact > 50
    _assert_reads_cover(plan)


def test_flattened_optimizer_is_read_whole_and_becomes_model_space(src):
    _, meta, _ = src[FLAT]
    plan = _plan(src, FLAT, Layout(tp=1, pp=1))
    assert plan.ok
    assert any("converted to model space" in p.reason for p in plan.problems)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    t = plan.target_meta.tensors[key]
    assert t.shape == (4, 256, 64) and t.stored_shape is None
    (rank,) = plan.ranks
    reads = [r for r in rank.reads() if r.key == key]
    assert {(r.file, r.byte_offset) for r in reads} == {
        (c.file, c.byte_offset) for c in meta.tensors[key].chunks}
    assert all(r.flat_range is not None and r.byte_length == r.chunk.byte_length
               for r in reads)


def _execute(reader, plan, rank):
    """Each local tensor of ``rank`` from the plan's reads (regions read through the reader)."""
    import torch

    out = {}
    for tp_ in rank.tensors:
        local = torch.full(tp_.local_shape, float("nan"))
        for pp_ in tp_.pieces:
            pc = pp_.piece
            if pc.fill:
                row = reader.read(tp_.key, (slice(pc.fill_row, pc.fill_row + 1),))
                local[tuple(slice(o, o + s) for o, s in zip(pc.local_offsets, pc.sizes))] = row
                continue
            for r in pp_.reads:
                (ro, rs) = r.region
                dst = tuple(slice(o - g + lo, o - g + lo + s) for o, s, g, lo in
                            zip(ro, rs, pc.global_offsets, pc.local_offsets))
                local[dst] = reader.read(tp_.key, tuple(slice(o, o + s) for o, s in
                                                        zip(ro, rs))).float()
        out[(tp_.key, tp_.pieces[0].piece.global_offsets)] = (tp_, local)
    return out


def test_executed_tp4_plan_gives_the_global_slices(src):
    torch = pytest.importorskip("torch")
    reader, _, _ = src[FP32]
    plan = _plan(src, FP32, Layout(tp=4, pp=1))
    for rank in plan.ranks:
        for (key, _), (tp_, local) in _execute(reader, plan, rank).items():
            assert not torch.isnan(local).any(), key
            full = reader.read(key)
            for pp_ in tp_.pieces:
                pc = pp_.piece
                got = local[tuple(slice(o, o + s) for o, s in zip(pc.local_offsets, pc.sizes))]
                if pc.fill:
                    assert torch.equal(got, full[pc.fill_row:pc.fill_row + 1].expand_as(got))
                else:
                    want = full[tuple(slice(o, o + s) for o, s in
                                      zip(pc.global_offsets, pc.sizes))]
                    assert torch.equal(got, want), key


def test_executed_legacy_target_plan_equals_the_legacy_files(src):
    """dist TP2/PP2 -> legacy TP2/PP2 plan, executed: every rank's tensors equal the real
    legacy rank files (dist names mapped to the module names legacy files use)."""
    torch = pytest.importorskip("torch")
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    reader, _, _ = src[FP32]
    plan = _plan(src, FP32, Layout(tp=2, pp=2), target_format="legacy")
    root = Path(src[LEGACY][1].root)
    n = 0
    for rank in plan.ranks:
        model = load_torch_file(root / rank.file)["model"]
        for (key, _), (tp_, local) in _execute(reader, plan, rank).items():
            stacked = key.startswith("decoder.layers.")
            lk = key.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
            lk = lk.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
            if stacked:
                layer = tp_.pieces[0].piece.global_offsets[0]
                lk = lk.replace("decoder.layers.", f"decoder.layers.{layer % 2}.", 1)
                local = local[0]
            assert torch.equal(local, model[lk]), (rank.file, lk)
            n += 1
    assert n == sum(1 for rp in plan.ranks for _ in rp.tensors) > 100


def test_legacy_target_virtual_pipeline_names(src):
    plan = _plan(src, LEGACY, Layout(tp=1, pp=2, vpp=2), target_format="legacy")
    assert plan.ok
    seen = {}
    for rp in plan.ranks:
        for t in rp.tensors:
            if t.key.endswith("self_attention.linear_qkv.weight"):
                seen[t.key] = (rp.pp, t.model_chunk, t.local_key)
    assert seen == {
        f"decoder.layers.{g}.self_attention.linear_qkv.weight":
            (g % 2, g // 2, "decoder.layers.0.self_attention.linear_qkv.weight")
        for g in range(4)}
    names = {rp.file for rp in plan.ranks}
    assert names == {"mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"}


def _synthetic(keys, tp, extra_common=None):
    tensors = {}
    for k, (shape, chunks) in keys.items():
        tensors[k] = TensorMeta(k, "float32", shape, tuple(
            ChunkRef(o, s, file="__0_0.distcp", byte_offset=0, byte_length=4 * math.prod(s),
                     layout="torch_save") for o, s in chunks))
    common = {"parallel": {"tp": tp, "pp": 1},
              "model": {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                        "num_query_groups": 2, "ffn_hidden_size": 16, "padded_vocab_size": 32,
                        "kv_channels": 4}, **(extra_common or {})}
    return CheckpointMeta("torch_dist", "", tensors=tensors, common=common)


def test_unknown_key_error_or_grid_inference():
    key = "decoder.layers.self_attention.adapter.weight"
    at_tp1 = _synthetic({key: ((2, 8, 8), [((0, 0, 0), (1, 8, 8)), ((1, 0, 0), (1, 8, 8))])}, 1)
    plan = plan_reshard(at_tp1, Layout(tp=2))
    (err,) = [p for p in plan.problems if p.severity == "error"]
    assert key in err.reason and "[[rules]]" in err.fix and not plan.ranks
    grid = [((l, 0, c), (1, 8, 4)) for l in range(2) for c in (0, 4)]
    at_tp2 = _synthetic({key: ((2, 8, 8), grid)}, 2)
    plan = plan_reshard(at_tp2, Layout(tp=1))
    assert plan.ok
    (rank,) = plan.ranks
    (t0, t1) = [t for t in rank.tensors if t.key == key]
    assert t0.local_shape == (1, 8, 8) and len(t0.pieces[0].reads) == 2


def test_dp_reshardable_optimizer_refused_unless_dropped():
    okey = ("optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, "
            "torch.float32).bucket_idx_0.exp_avg")
    meta = _synthetic({okey: ((100,), [((0,), (100,))]),
                       "decoder.final_layernorm.weight": ((8,), [((0,), (8,))])}, 2,
                      {"content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}})
    plan = plan_reshard(meta, Layout(tp=1))
    (err,) = [p for p in plan.problems if p.severity == "error"]
    assert not plan.ok and "dp_reshardable" in err.reason and "--drop-optimizer" in err.fix
    plan = plan_reshard(meta, Layout(tp=1), options=ReshardOptions(drop_optimizer=True))
    assert plan.ok and plan.dropped == [okey] and okey not in plan.target_meta.tensors
    assert all(t.key != okey for rp in plan.ranks for t in rp.tensors)
    assert any("dropped (--drop-optimizer)" in p.reason for p in plan.problems)
    same = plan_reshard(meta, Layout(tp=2))
    assert same.ok and same.target_meta.tensors[okey].chunks[0].file == "__0_0.distcp"


def test_experts_placed_by_expert_parallel():
    """Per-expert keys go to the ep rank owning the expert (ep-local numbers in legacy names);
    stacked expert keys split their expert axis by ep; expert TP follows etp."""
    fc1 = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    keys = {fc1.format(g): ((32, 8), [((0, 0), (32, 8))]) for g in range(4)}
    stacked = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    keys[stacked] = ((2, 4, 8, 16), [((0, 0, 0, 0), (2, 4, 8, 16))])
    meta = _synthetic(keys, 1, {"model": {"num_layers": 2, "hidden_size": 8,
                                          "num_attention_heads": 2, "num_query_groups": 2,
                                          "ffn_hidden_size": 16, "padded_vocab_size": 32,
                                          "kv_channels": 4, "num_experts": 4, "swiglu": True}})
    plan = plan_reshard(meta, Layout(tp=2, ep=2, etp=1), options=ReshardOptions(
        target_format="legacy"))
    assert plan.ok, plan.problems
    by = {(rp.tp, rp.ep): rp for rp in plan.ranks}
    assert by[(0, 1)].file == "mp_rank_00_001/model_optim_rng.pt"
    names = sorted(t.local_key for t in by[(0, 1)].tensors if "local_experts" in t.key)
    assert names == [fc1.format(0), fc1.format(1)]
    assert sorted(t.key for t in by[(0, 1)].tensors if "local_experts" in t.key) == [
        fc1.format(2), fc1.format(3)]
    assert not [t for t in by[(1, 0)].tensors if "experts" in t.key]  # etp=1: tp rank 0 only
    st = [t for t in by[(0, 1)].tensors if t.key == stacked]
    assert sorted(t.pieces[0].piece.global_offsets[:2] for t in st) == [
        (0, 2), (0, 3), (1, 2), (1, 3)]
    assert all(t.local_shape == (1, 1, 8, 16) for t in st)


def test_legacy_target_tied_last_stage_holds_output_layer(src):
    """Tied embeddings at PP > 1: Megatron-LM's last stage has (and strictly loads) its own
    ``output_layer.weight``, a copy of the embedding's TP shard; the dist checkpoint has only
    the embedding."""
    import dataclasses

    r, meta, common = src[FP32]
    tied = dataclasses.replace(meta, tensors={k: v for k, v in meta.tensors.items()
                                              if k != "output_layer.weight"})
    plan = plan_reshard(tied, Layout(tp=2, pp=2), options=ReshardOptions(
        target_format="legacy"), common=common)
    assert plan.ok
    out = {(rp.tp, rp.pp): t for rp in plan.ranks for t in rp.tensors
           if t.local_key == "output_layer.weight"}
    emb = {(rp.tp, rp.pp): t for rp in plan.ranks for t in rp.tensors
           if t.local_key == "embedding.word_embeddings.weight"}
    assert set(out) == {(0, 1), (1, 1)} and set(emb) == {(0, 0), (1, 0)}
    for t in (0, 1):
        assert out[(t, 1)].key == "embedding.word_embeddings.weight"
        assert out[(t, 1)].local_shape == emb[(t, 0)].local_shape
        assert [p.piece for p in out[(t, 1)].pieces] == [p.piece for p in emb[(t, 0)].pieces]
    assert "output_layer.weight" not in plan.target_meta.tensors
    untied = _plan(src, FP32, Layout(tp=2, pp=2), target_format="legacy")
    assert sum(t.local_key == "output_layer.weight" and t.key == "output_layer.weight"
               for rp in untied.ranks for t in rp.tensors) == 2  # its own, not a copy
    pp1 = plan_reshard(tied, Layout(tp=2, pp=1), options=ReshardOptions(
        target_format="legacy"), common=common)
    assert not [t for rp in pp1.ranks for t in rp.tensors if t.local_key == "output_layer.weight"]


def test_legacy_target_virtual_pipeline_last_chunk_holds_head(src):
    """With a virtual pipeline the final norm and output layer are in the last stage's last
    model chunk (``model1``), the embedding in the first stage's first (``model0``)."""
    plan = _plan(src, LEGACY, Layout(tp=1, pp=2, vpp=2), target_format="legacy")
    where = {t.local_key: (rp.pp, t.model_chunk) for rp in plan.ranks for t in rp.tensors
             if "layers." not in t.local_key}
    assert where == {"embedding.word_embeddings.weight": (0, 0),
                     "embedding.position_embeddings.weight": (0, 0),
                     "decoder.final_layernorm.weight": (1, 1),
                     "decoder.final_layernorm.bias": (1, 1), "output_layer.weight": (1, 1)}
