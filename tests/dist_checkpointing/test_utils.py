"""Sharded-state-dict helpers: splitting, renaming, debug timing; equality with Megatron-Core."""

from __future__ import annotations

import logging

import pytest
import torch

from ckpt_tool.dist_checkpointing import mapping, utils
from ckpt_tool.dist_checkpointing.dict_utils import nested_values
from ckpt_tool.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)


@pytest.fixture(scope="module")
def mc():
    mapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    mutils = pytest.importorskip("megatron.core.dist_checkpointing.utils")
    return mapping, mutils


def build_sd(m):
    """A small sharded state dict built with mapping module ``m`` (ours or MCore's)."""
    w = torch.arange(6.0).reshape(2, 3)
    return {
        "model": {
            "decoder.w": m.ShardedTensor.from_rank_offsets("decoder.w", w, (0, 1, 2)),
            "decoder.extra": m.ShardedObject("decoder.extra", {"v": 1}, (2,), (1,)),
            "emb": [m.ShardedTensor.from_rank_offsets("embedding.w", w.clone()), 7],
            "fac": m.ShardedTensorFactory("decoder.fac", w, lambda *a: {}, lambda s: s),
        },
        "optimizer": {"groups": m.LocalNonpersistentObject([0, 1]), "lr": 0.1},
        "iteration": 5,
        "empty": {},
    }


def describe(x):
    """Comparable summary of a (possibly nested) split result."""
    if isinstance(x, dict):
        return {k: describe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(describe(v) for v in x)
    if hasattr(x, "key"):
        return (type(x).__name__, x.key)
    if hasattr(x, "unwrap"):
        return ("LocalNonpersistentObject", x.unwrap())
    return x


EXTRACTORS = [
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
]


def test_extract_sharded_tensors():
    tensors, rest = utils.extract_sharded_tensors(build_sd(mapping))
    assert describe(tensors) == {"model": {"decoder.w": ("ShardedTensor", "decoder.w"),
                                           "emb": [("ShardedTensor", "embedding.w")]}}
    assert rest["iteration"] == 5 and rest["empty"] == {} and rest["model"]["emb"] == [7]
    assert isinstance(rest["model"]["fac"], ShardedTensorFactory)


def test_extract_kinds():
    sd = build_sd(mapping)
    base, _ = utils.extract_sharded_base(sd)
    assert {type(v) for v in nested_values(base)} == {
        ShardedTensor, ShardedObject, ShardedTensorFactory}
    nonp, _ = utils.extract_nonpersistent(sd)
    assert describe(nonp) == {"optimizer": {"groups": ("LocalNonpersistentObject", [0, 1])}}
    mixed, _ = utils.extract_sharded_tensors_or_nonpersistent(sd)
    assert {type(v) for v in nested_values(mixed)} == {
        ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject}


def test_prefix_helpers():
    sd = build_sd(mapping)
    utils.add_prefix_for_sharding(sd, "m.")
    keys = sorted(v.key for v in nested_values(sd) if hasattr(v, "key"))
    assert keys == ["m.decoder.extra", "m.decoder.fac", "m.decoder.w", "m.embedding.w"]
    utils.replace_prefix_for_sharding(sd, "m.", "")
    utils.apply_prefix_mapping(sd, {"decoder.": "dec.", "dec": "never-used", "x": "y"})
    keys = sorted(v.key for v in nested_values(sd) if hasattr(v, "key"))
    assert keys == ["dec.extra", "dec.fac", "dec.w", "embedding.w"]
    with pytest.raises(ValueError, match="begin with prefix"):
        utils.replace_prefix_for_sharding(sd, "dec.", "")


def test_zip_strict():
    assert list(utils.zip_strict([1, 2], "ab")) == [(1, "a"), (2, "b")]
    with pytest.raises(AssertionError, match=r"\[2, 1\]"):
        utils.zip_strict([1, 2], [1])


def test_shard_ids():
    t = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 1, 2))
    assert utils._sharded_tensor_shard_id(t) == ("w", (2,), None)
    flat = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(1), (2,), (0, 1, 2), flattened_range=slice(1, 2))
    assert utils._sharded_tensor_shard_id(flat) == ("w", (2,), (1, 2))
    assert utils._sharded_object_id(ShardedObject("o", None, (2,), (1,))) == ("o", (1,), (2,))


def test_force_all_tensors_to_non_fp8():
    class Float8Tensor:  # stands in for Transformer Engine's class (matched by name)
        def dequantize(self):
            return torch.ones(2)

    holder = type("Holder", (), {})()
    holder.data = Float8Tensor()
    plain = ShardedTensor.from_rank_offsets("w", torch.zeros(2))
    sd = {"a": holder, "b": plain, "c": 3}
    utils.force_all_tensors_to_non_fp8(sd)
    assert torch.equal(holder.data, torch.ones(2))
    assert torch.equal(plain.data, torch.zeros(2))


def test_debug_time_logs(caplog):
    log = logging.getLogger("ckpt_tool.test_debug_time")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        with utils.debug_time("outer", log):
            with utils.debug_time("inner"):
                utils.debug_msg("hello")
        with utils.debug_time("fast", log, threshold=3600):
            pass
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "outer.inner hello"
    assert messages[1].startswith("outer.inner took ")
    assert messages[2].startswith("outer took ")
    assert not any(m.startswith("fast") for m in messages)


def test_clean_metadata():
    assert utils._clean_metadata_for_serialization(None) is None
    meta = {"dp_cp_group": object(), "a": 1}
    assert utils._clean_metadata_for_serialization(meta) == {"a": 1}
    assert "dp_cp_group" in meta


@pytest.mark.interop
class TestAgainstMegatronCore:
    @pytest.mark.parametrize("name", EXTRACTORS)
    def test_extractors(self, mc, name):
        mmapping, mutils = mc
        ours = getattr(utils, name)(build_sd(mapping))
        theirs = getattr(mutils, name)(build_sd(mmapping))
        assert describe(ours) == describe(theirs)

    def test_prefix_helpers(self, mc):
        mmapping, mutils = mc
        results = []
        for m, u in ((mapping, utils), (mmapping, mutils)):
            sd = build_sd(m)
            u.add_prefix_for_sharding(sd, "p.")
            u.replace_prefix_for_sharding(sd, "p.", "q.")
            u.apply_prefix_mapping(sd, {"q.decoder.": "D.", "q.": "Q.", "D": "never"})
            results.append(describe(sd))
        assert results[0] == results[1]
