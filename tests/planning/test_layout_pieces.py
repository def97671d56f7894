"""Pieces against the real Megatron-Core sharding: the TP2/PP2 chunk grid of the dist
fixtures (every chunk of every key, and which rank's file holds it), the per-rank tensors of
the legacy fixtures (assembled from the dist fixture with our pieces), tilings for tp in
(1, 2, 4), GLU/vocab details and the layer placement."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from ckpt_tool.formats.legacy import layout as L
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.planning.layout import GLU, REPLICATED, Rule, model_key, rule_for
from ckpt_tool.planning.pieces import (FILL_COPY, FILL_ZERO, global_pieces, rank_pieces,
                                       tp_pieces)
from ckpt_tool.planning.sizes import LayerMap, Layout, padded_vocab_size, stage_layer_counts

TP2PP2 = ["fixtures/mcore016_gpt_tp2pp2_fp32", "fixtures/mcore016_gpt_tp2pp2_bf16_optim",
          "fixtures/mcore015_zarr_gpt_tp2pp2"]


def _rank_boxes(key, shape, tp, pp, num_layers):
    """(offsets, sizes) -> set of global ranks holding it, per Megatron-Core main replicas."""
    lm = LayerMap(num_layers, Layout(tp=tp, pp=pp))
    rule = rule_for(key)
    out: dict[tuple, set[int]] = {}
    stacked = key.startswith("decoder.layers.")
    for p in range(pp):
        if not stacked:
            last = key.startswith(("output_layer", "decoder.final_layernorm"))
            if p != (pp - 1 if last else 0):
                continue
        for t in range(tp):
            if rule.kind == REPLICATED and t:
                continue
            for lt in rank_pieces(key, shape, rule, tp=tp, tp_rank=t,
                                  layers=lm.layers_of(p) if stacked else None):
                boxes = ([(pc.global_offsets, pc.sizes) for pc in lt.pieces]
                         if rule.kind == GLU else
                         [(lt.pieces[0].global_offsets, lt.local_shape)])
                for b in boxes:
                    out.setdefault(b, set()).add(t + tp * p)
    return out


@pytest.mark.parametrize("fixture", TP2PP2)
def test_tp2pp2_chunk_grid_is_mcores(fixture):
    meta = open_checkpoint(fixture).metadata()
    n = 0
    for key, t in meta.tensors.items():
        mk = model_key(key)
        ours = _rank_boxes(mk, t.shape, 2, 2, 4)
        stored = {(c.offsets, c.sizes): c.file for c in t.chunks}
        assert set(ours) == set(stored), key
        for box, f in stored.items():
            m = re.match(r"^__(\d+)_\d+\.distcp$", f or "")
            if m:  # torch_dist: the file names the saving rank
                assert ours[box] == {int(m.group(1))}, (key, box)
        n += len(stored)
    assert n >= 90


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("key, shape", [
    ("decoder.layers.self_attention.linear_qkv.weight", (4, 128, 64)),
    ("decoder.layers.self_attention.linear_qkv.bias", (4, 128)),
    ("decoder.layers.mlp.linear_fc1.weight", (4, 256, 64)),
    ("decoder.layers.mlp.linear_fc1.bias", (4, 256)),
    ("decoder.layers.mlp.linear_fc2.weight", (4, 64, 128)),
    ("decoder.layers.self_attention.linear_proj.weight", (4, 64, 64)),
    ("embedding.word_embeddings.weight", (128, 64)),
    ("decoder.layers.mlp.linear_fc2.bias", (4, 64)),
])
def test_pieces_tile_the_tensor(key, shape, tp):
    """Across the tp ranks, pieces cover every element once (replicated: every rank holds it
    all); each local tensor is filled exactly by its pieces."""
    rule = rule_for(key)
    boxes = []
    for r in range(tp):
        for lt in rank_pieces(key, shape, rule, tp=tp, tp_rank=r):
            assert sum(math.prod(p.sizes) for p in lt.pieces) == math.prod(lt.local_shape)
            if rule.kind == REPLICATED:
                assert lt.local_shape == (1, *shape[1:])  # one layer of the stacked key
            else:
                boxes += [(p.global_offsets, p.sizes) for p in lt.pieces]
    if rule.kind == REPLICATED:
        return
    for i, (ao, asz) in enumerate(boxes):
        for bo, bsz in boxes[i + 1:]:
            assert not all(a < b + bs and b < a + as_ for a, as_, b, bs in
                           zip(ao, asz, bo, bsz)), (ao, bo)
    assert sum(math.prod(z) for _, z in boxes) == math.prod(shape)


def test_glu_rank_holds_its_w_and_v_rows():
    # tp=4, F=128: rank r holds W rows [32r, 32r+32) then V rows [128+32r, ...)
    local, pieces = tp_pieces(GLU, (256, 64), 0, 4, 3)
    assert local == (64, 64)
    assert [(p.global_offsets, p.sizes, p.local_offsets) for p in pieces] == [
        ((96, 0), (32, 64), (0, 0)), ((224, 0), (32, 64), (32, 0))]
    rule = rule_for("decoder.layers.mlp.linear_fc1.weight")
    # without a gated linear unit fc1 is a plain column split
    (lt,) = rank_pieces("decoder.layers.0.mlp.linear_fc1.weight", (128, 64), rule, tp=2,
                        tp_rank=1, gated=False)
    assert [(p.global_offsets, p.sizes) for p in lt.pieces] == [((64, 0), (64, 64))]


@pytest.mark.parametrize("fill", [FILL_COPY, FILL_ZERO])
def test_vocab_repad_fill_pieces(fill):
    rule = rule_for("output_layer.weight")
    got = [rank_pieces("output_layer.weight", (256, 64), rule, tp=4, tp_rank=r,
                       source_rows=150, fill=fill)[0] for r in range(4)]
    assert all(lt.local_shape == (64, 64) for lt in got)
    assert [len(lt.pieces) for lt in got] == [1, 1, 2, 1]
    cut = got[2].pieces
    assert (cut[0].global_offsets, cut[0].sizes, cut[0].fill) == ((128, 0), (22, 64), None)
    assert (cut[1].global_offsets, cut[1].sizes, cut[1].local_offsets) == \
        ((150, 0), (42, 64), (22, 0))
    assert cut[1].fill == fill and cut[1].fill_row == (149 if fill == FILL_COPY else None)
    assert got[3].pieces[0].fill == fill and got[3].pieces[0].sizes == (64, 64)


def test_padded_vocab_is_megatron_lms():
    assert padded_vocab_size(128, 2, 64) == 128
    assert padded_vocab_size(128, 4, 64) == 256
    assert padded_vocab_size(50257, 8, 128) == 51200
    assert padded_vocab_size(100, 3, 1) == 102


def test_global_pieces_match_legacy_reader_chunks():
    """The inverse view places each legacy rank's local tensor where the reader does."""
    meta = open_checkpoint("fixtures/megatron_legacy_tp2pp2").metadata()
    for key, t in meta.tensors.items():
        rule = rule_for(key)
        for c in t.chunks:
            tp = L.parse_rank_dir(c.file.split("/")[0], 2)[0]
            local = list(t.shape)
            if rule.kind != REPLICATED:
                local[rule.axis] //= 2
            gshape, pieces = global_pieces(key, local, rule, tp=2, tp_rank=tp)
            assert gshape == t.shape
            assert (c.offsets, c.sizes) in {(p.global_offsets, p.sizes) for p in pieces}, key


def _legacy_local_key(dist_key: str, local_layer: int | None) -> str:
    k = dist_key.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
    k = k.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
    if local_layer is not None:
        k = k.replace("decoder.layers.", f"decoder.layers.{local_layer}.", 1)
    return k


@pytest.mark.parametrize("legacy, pp", [("fixtures/megatron_legacy_tp2pp2", 2),
                                        ("fixtures/megatron_legacy_tp2_release", 1)])
def test_pieces_rebuild_legacy_rank_tensors_from_dist(legacy, pp):
    """Per-rank tensors assembled from the dist fixture with our pieces equal the tensors the
    real Megatron-Core model saved in each legacy rank file (reads data)."""
    torch = pytest.importorskip("torch")
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    dist = open_checkpoint("fixtures/mcore016_gpt_tp2pp2_fp32")
    dmeta = dist.metadata()
    lm = LayerMap(4, Layout(tp=2, pp=pp))
    root = Path(open_checkpoint(legacy).metadata().root)
    checked = 0
    for t in range(2):
        for p in range(pp):
            name = L.rank_dir_name(t, p, 0, pp, 1)
            model = load_torch_file(root / name / "model_optim_rng.pt")["model"]
            want_keys = {k for k, v in model.items() if v is not None}
            got_keys = set()
            for key, tm in dmeta.tensors.items():
                stacked = key.startswith("decoder.layers.")
                if not stacked and key.startswith(("output_layer", "decoder.final")) \
                        and p != pp - 1 or not stacked and key.startswith("embedding") and p:
                    continue
                layers = lm.layers_of(p) if stacked else None
                for lt in rank_pieces(key, tm.shape, rule_for(key), tp=2, tp_rank=t,
                                      layers=layers):
                    local = torch.empty(lt.local_shape, dtype=torch.float32)
                    for pc in lt.pieces:
                        src = dist.read(key, tuple(slice(o, o + s) for o, s in
                                                   zip(pc.global_offsets, pc.sizes)))
                        local[tuple(slice(o, o + s) for o, s in
                                    zip(pc.local_offsets, pc.sizes))] = src
                    local_layer = lm.locate(lt.pieces[0].global_offsets[0])[2] \
                        if stacked else None
                    lk = _legacy_local_key(key, local_layer)
                    got = local[0] if stacked else local
                    assert torch.equal(got, model[lk]), (name, lk)
                    got_keys.add(lk)
                    checked += 1
            assert got_keys == want_keys, name
    assert checked > 100


def test_layer_map_matches_legacy_offsets_and_megatron_formula():
    for n, pp in [(4, 1), (4, 2), (8, 4), (12, 3)]:
        lm = LayerMap(n, Layout(pp=pp))
        assert [lm.offset(p) for p in range(pp)] == L.stage_layer_offsets(n, pp)
        for layer in range(n):
            p, vp, local = lm.locate(layer)
            assert lm.global_index(p, local, vp) == layer
    for n, pp, vpp in [(8, 2, 2), (16, 4, 2), (12, 2, 3)]:
        lm = LayerMap(n, Layout(pp=pp, vpp=vpp))
        for p in range(pp):
            for v in range(vpp):
                assert lm.offset(p, v) == L.virtual_layer_offset(n, pp, vpp, p, v)
    # uneven: 10 layers, pp=4, first 1, last 3 -> [1, 3, 3, 3]
    lm = LayerMap(10, Layout(pp=4, first_stage_layers=1, last_stage_layers=3))
    assert [lm.layers_of(p) for p in range(4)] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert stage_layer_counts(10, 4, 1, None) == [1, 3, 3, 3]
    with pytest.raises(ValueError, match="do not split evenly"):
        stage_layer_counts(10, 4)
    with pytest.raises(ValueError, match="do not add up"):
        stage_layer_counts(10, 2, 4, 4)


@pytest.mark.interop
def test_layer_map_equals_mcore_get_transformer_layer_offset():
    pytest.importorskip("megatron.core")
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cases = [(8, 2, None, None, None), (8, 2, 2, None, None), (10, 4, None, 1, 3),
             (12, 3, 2, 2, 4), (14, 4, 2, None, 2), (9, 3, None, 3, None)]
    for n, pp, vpp, first, last in cases:
        cfg = SimpleNamespace(
            num_layers=n, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, pipeline_model_parallel_layout=None,
            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False, mtp_num_layers=None)
        lm = LayerMap(n, Layout(pp=pp, vpp=vpp, first_stage_layers=first,
                                last_stage_layers=last))
        for p in range(pp):
            for v in range(vpp or 1):
                want = get_transformer_layer_offset(cfg, vp_stage=v if vpp else None,
                                                    pp_rank=p)
                assert lm.offset(p, v) == want, (n, pp, vpp, first, last, p, v)


def test_rule_axis_override_moves_the_split():
    rule = Rule(r"x$", "column", axis=1, ndim=2)
    (lt,) = rank_pieces("decoder.layers.x", (4, 8, 6), rule, tp=2, tp_rank=1, layers=[3])
    assert lt.local_shape == (1, 8, 3)
    assert [(p.global_offsets, p.sizes) for p in lt.pieces] == [((3, 0, 3), (1, 8, 3))]
