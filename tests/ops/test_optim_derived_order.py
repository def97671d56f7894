"""The DistributedOptimizer's bucket layout read off the stored data
(ckpt_tool.ops._optim_derived_order, planning.param_placement): on every ``dp_reshardable``
checkpoint the REAL Megatron-Core wrote whose layer spec's order is known, the order read off
the data places every parameter exactly where the known order does (the known order is itself
proven against every stored piece); and the walk's refusals on synthetic buffers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops._optim_derived_order import derive_bucket_layout
from ckpt_tool.ops._optim_unflatten import UnflattenedOptimizerView
from ckpt_tool.planning.optim_buckets import Bucket, BucketLayoutError
from ckpt_tool.planning.param_placement import (AmbiguousPlacement, BufferToPlace, Candidate,
                                                place_buffer)
from ckpt_tool.planning.pieces import LocalTensor, Piece
from ckpt_tool.planning.source_layout import configured_args, source_layout_from
from ckpt_tool.planning.source_model import model_sizes_from

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.mark.parametrize("fixture", [
    "mcore016_gpt_tp2dp2_distopt_buckets", "mcore016_gpt_pp2dp2_distopt_buckets",
    "mcore016_moe_ep2_distopt_buckets", "mcore016_mixtral_ep2", "mcore016_llama_tp2pp2_distopt",
    "mcore016_gpt_tp2dp2_distopt_noargs/dp_reshardable", "mcore019_gpt_tp2dp2_distopt_buckets",
    "mcore016_gpt_tp2dp2_distopt_bridge"])
def test_order_read_off_the_data_is_the_known_one(fixture):
    reader = open_checkpoint(locate_source(FIXTURES / fixture).checkpoint)
    meta, common = reader.metadata(), reader.common()
    known = UnflattenedOptimizerView(reader)
    per_bucket, _groups = known._group_objects(meta)
    derived, leftover = derive_bucket_layout(
        reader, meta, model_sizes_from(meta, common), source_layout_from(meta, common),
        configured_args(meta, common)[0], None, per_bucket, known.choice.dp)

    def placed(buckets):
        return {(b.prefix, b.dp_group_idx, b.gbuf_idx, b.bucket_idx, b.numel, b.numel_unpadded):
                [(p.key, p.start, p.numel, p.local) for p in b.params] for b in buckets}

    assert placed(derived) == placed(known.buckets)
    assert sum(len(b.params) for b in derived) > 10
    assert leftover == []


def _candidate(key, numel):
    return Candidate(key, None, None, LocalTensor(key, (numel,), (Piece((0,), (numel,), (0,)),)))


def _buffer(candidates, unpadded, starts):
    return BufferToPlace(Bucket(0, 0, 0, 0, "(torch.bfloat16, torch.float32)", 0, dp=1),
                         candidates, [-(-unpadded // 128) * 128], [unpadded], [set(starts)])


def test_walk_places_by_value_and_reports_what_no_bucket_holds():
    a, b, c = _candidate("a", 64), _candidate("b", 64), _candidate("buf", 10)
    values = {(0, "b"), (64, "a")}  # the main parameter at 0 is b's, at 64 a's
    buckets, left = place_buffer(_buffer([a, b, c], 128, {0, 64}),
                                 lambda _b, pos, fit: [x for x in fit if (pos, x.key) in values],
                                 lambda slots: True)
    assert [(p.key, p.start) for p in buckets[0].params] == [("b", 0), ("a", 64)]
    assert left == [c]


def test_walk_refuses_a_slot_no_weight_matches():
    a, b = _candidate("a", 64), _candidate("b", 64)
    with pytest.raises(BucketLayoutError, match="equals none of the 2 parameters"):
        place_buffer(_buffer([a, b], 128, {0, 64}), lambda *_: [], lambda slots: True)


def test_walk_refuses_pieces_no_parameter_ends_at():
    a = _candidate("a", 100)
    with pytest.raises(BucketLayoutError, match="no parameter of the model ends"):
        place_buffer(_buffer([a], 128, {0, 64}), lambda _b, _p, fit: fit, lambda slots: True)


@pytest.mark.parametrize("same,ok", [(True, True), (False, False)])
def test_identical_weights_swap_only_where_that_moves_nothing(same, ok):
    a, b = _candidate("norm_a", 64), _candidate("norm_b", 64)
    run = lambda: place_buffer(_buffer([a, b], 128, {0, 64}),  # noqa: E731
                               lambda _b, _p, fit: fit, lambda slots: same)
    if ok:
        buckets, _left = run()
        assert len(buckets[0].params) == 2
    else:
        with pytest.raises(AmbiguousPlacement, match="norm_a, norm_b"):
            run()
