"""What the DistributedOptimizer's bucket layout may be when the configuration leaves it open,
decided from metadata alone, on checkpoints the real Megatron-Core 0.16.1 wrote: the stored
``per_bucket_numel_unpadded`` close the buckets exactly where the configured bucket size does,
and the stored pieces tell the data-parallel size."""

from __future__ import annotations

from pathlib import Path

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.planning.bucket_choices import (LayoutChoice, dp_candidates, layout_choices,
                                               stored_bucket_sizes)
from ckpt_tool.planning.bucket_proof import prove_bucket_layout
from ckpt_tool.planning.optim_buckets import optimizer_bucket_layout
from ckpt_tool.planning.source_layout import args_of, source_layout_from
from ckpt_tool.planning.source_model import model_sizes_from

FIX = Path(__file__).resolve().parents[2] / "fixtures"
ARGS = FIX / "mcore016_gpt_tp2dp2_distopt_buckets"   # Megatron-LM args: bucket size 20000
NOARGS = FIX / "mcore016_gpt_tp2dp2_distopt_noargs" / "dp_reshardable"


def _per_bucket(reader):
    per = {}
    for o in reader.metadata().objects:
        for i, name in enumerate(("per_bucket_numel", "per_bucket_numel_unpadded")):
            if o.key.endswith("." + name):
                idx = int(o.key.split("dp_group_idx_")[1].split(".")[0])
                per.setdefault(("", idx), [None, None])[i] = reader.read_object(o.unique_key)
    return per


def _layout(buckets):
    return [(b.key("param"), b.numel, b.numel_unpadded, [(p.key, p.start, p.numel)
                                                         for p in b.params]) for b in buckets]


def test_stored_bucket_sizes_close_the_buckets_where_the_configured_size_does():
    reader = open_checkpoint(ARGS)
    meta, common = reader.metadata(), reader.common()
    args, per = args_of(meta, common), _per_bucket(reader)
    sizes, source = model_sizes_from(meta, common), source_layout_from(meta, common)
    configured = optimizer_bucket_layout(meta, sizes, source, args)
    silent = {k: v for k, v in args.items()
              if k not in ("overlap_grad_reduce", "ddp_bucket_size", "data_parallel_size",
                           "world_size")}
    stored = optimizer_bucket_layout(meta, sizes, source, silent, dp=2,
                                     stored=stored_bucket_sizes(per))
    assert len(configured) == 8 and _layout(stored) == _layout(configured)
    assert prove_bucket_layout(stored, meta, per, 2) == []


def test_the_stored_pieces_bound_the_data_parallel_size():
    """DP 2: each bucket's second half starts a stored piece; 4 would need pieces at the
    quarters. (1 needs nothing; the proof rejects it: the piece at the half is no parameter
    boundary.)"""
    for path in (ARGS, NOARGS):
        reader = open_checkpoint(path)
        meta, per = reader.metadata(), _per_bucket(reader)
        assert dp_candidates(meta, per) == [1, 2], path
        sizes, source = model_sizes_from(meta, {}), source_layout_from(meta, {})
        args = {"transformer_impl": "local"}
        stored = stored_bucket_sizes(per)
        assert prove_bucket_layout(optimizer_bucket_layout(meta, sizes, source, args, dp=2,
                                                           stored=stored), meta, per, 2) == []
        assert prove_bucket_layout(optimizer_bucket_layout(meta, sizes, source, args, dp=1,
                                                           stored=stored), meta, per, 1)


def test_what_the_configuration_leaves_open_is_tried():
    assert layout_choices({}, [2], padded=[2 ** 16]) == [
        LayoutChoice(s, 2, b) for s in ("transformer_engine", "local") for b in (False, True)]
    # stored buckets not padded to 2**16: not the bus-bandwidth padding
    assert {c.busbw for c in layout_choices({}, [2], padded=[8448, 2 ** 16])} == {False}
    assert layout_choices({"transformer_impl": "local",
                           "ddp_pad_buckets_for_high_nccl_busbw": False}, [1, 2]) == [
        LayoutChoice("local", 1, False), LayoutChoice("local", 2, False)]
    assert [c.spec for c in layout_choices({"transformer_impl": "local"}, [1],
                                           spec="transformer_engine")] == ["transformer_engine"]
