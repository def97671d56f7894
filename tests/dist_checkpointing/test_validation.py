"""Sharding-integrity and strict-load validation; side by side with Megatron-Core."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from ckpt_tool.dist_checkpointing import mapping, validation
from ckpt_tool.dist_checkpointing.core import CheckpointingConfig, save_config
from ckpt_tool.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
)
from ckpt_tool.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_objects_sharding_integrity,
    validate_sharding_integrity,
)

# ---------------------------------------------------------------- layouts (ours or MCore's)
# Each builder returns the per-rank metadata lists that determine_global_metadata would gather.


def tp_dp(m, tp=2, dp=2, force_main=(), dtype_of=None, shape_of=None):
    """TP-split tensor + per-TP-rank ShardedObject on tp*dp ranks (rank = dp_rank*tp + tp_rank)."""
    ranks = []
    for rank in range(tp * dp):
        tp_rank, dp_rank = rank % tp, rank // tp
        replica = 0 if rank in force_main else (0, dp_rank)
        dtype = (dtype_of or {}).get(rank, torch.float32)
        local = (shape_of or {}).get(rank, (2, 6))
        ranks.append([
            m.ShardedTensor.from_rank_offsets(
                "w", torch.zeros(local, dtype=dtype), (0, tp_rank, tp), replica_id=replica
            ).without_data(),
            m.ShardedObject("rng", None, (tp,), (tp_rank,), replica_id=replica),
        ])
    return ranks


def stacked_layers(m, pp=2, per_stage=2, drop_layer=None, dup_layer=None):
    """Per-layer chunks of a stacked [layers, 3, 4] tensor, layer axis prepended."""
    ranks = []
    total = pp * per_stage
    for stage in range(pp):
        entries = []
        for i in range(per_stage):
            layer = stage * per_stage + i
            if layer == drop_layer:
                continue
            if layer == dup_layer and stage == 0:
                layer = per_stage  # also claim the first layer of stage 1
            entries.append(m.ShardedTensor.from_rank_offsets(
                "layers.w", torch.zeros(3, 4), (0, layer, total), prepend_axis_num=1))
        ranks.append(entries)
    return ranks


def objects(m, offsets_and_replicas, shape=(2,)):
    return [[m.ShardedObject("obj", None, shape, off, replica_id=rep)]
            for off, rep in offsets_and_replicas]


def without_tensor_on_rank(ranks, rank):
    """Drop ``rank``'s ShardedTensor: with tp_dp, rank 1 holds the only main copy of chunk 1."""
    ranks[rank] = [x for x in ranks[rank] if not hasattr(x, "local_shape")]
    return ranks


VALID = {
    "tp_dp": lambda m: tp_dp(m),
    "tp4_dp1": lambda m: tp_dp(m, tp=4, dp=1),
    "layers": lambda m: stacked_layers(m),
    "layers_pp1": lambda m: stacked_layers(m, pp=1, per_stage=3),
    "objects_replicated": lambda m: objects(m, [((0,), 0), ((1,), 0), ((0,), 1), ((1,), (0, 2))]),
}
INVALID = {
    "gap_tensor": lambda m: without_tensor_on_rank(tp_dp(m), 1),
    "overlap_tensor": lambda m: [r[:1] for r in tp_dp(m, force_main=(0, 2))],
    "missing_layer": lambda m: stacked_layers(m, drop_layer=1),
    "duplicated_layer": lambda m: stacked_layers(m, dup_layer=1),
    "objects_duplicate": lambda m: objects(m, [((0,), 0), ((0,), 0), ((1,), 0)]),
    "objects_missing": lambda m: objects(m, [((0,), 0), ((1,), 1)]),
    "dtype_mismatch": lambda m: [r[:1] for r in tp_dp(m, dtype_of={3: torch.bfloat16})],
    "shape_mismatch": lambda m: [r[:1] for r in tp_dp(m, shape_of={1: (3, 6)})],
}


class TestShardingIntegrity:
    @pytest.mark.parametrize("name", sorted(VALID))
    def test_valid(self, name):
        validate_sharding_integrity(VALID[name](mapping))

    @pytest.mark.parametrize("name", sorted(INVALID))
    def test_invalid(self, name):
        with pytest.raises(CheckpointingException):
            validate_sharding_integrity(INVALID[name](mapping))

    def test_error_names_the_problem(self):
        more_than_once = r"saved more than once.*\(\(0, 0\), 2\)"
        with pytest.raises(CheckpointingException, match=more_than_once):
            validate_sharding_integrity(INVALID["overlap_tensor"](mapping))
        with pytest.raises(CheckpointingException, match=r"saved by no main replica.*\(1, 0, 0\)"):
            validate_sharding_integrity(INVALID["missing_layer"](mapping))

    def test_mixed_kinds_under_one_key(self):
        meta = [[ShardedTensor.from_rank_offsets("k", torch.zeros(2))],
                [ShardedObject("k", None, (1,), (0,))]]
        with pytest.raises(CheckpointingException, match="different kinds"):
            validate_sharding_integrity(meta)

    @pytest.mark.parametrize("ranges, ok", [
        ([(0, 5), (5, 12)], True),
        ([(5, 12), (0, 5), (3, 4)], False),  # overlap
        ([(0, 5), (6, 12)], False),  # gap
        ([(0, 5)], False),  # short
    ])
    def test_flattened(self, ranges, ok):
        meta = [[ShardedTensor.from_rank_offsets_flat(
            "f", torch.zeros(stop - start), (3, 4), flattened_range=slice(start, stop))]
            for start, stop in ranges]
        if ok:
            validate_sharding_integrity(meta)
        else:
            with pytest.raises(CheckpointingException):
                validate_sharding_integrity(meta)

    @pytest.mark.parametrize("chunks, ok", [
        ([((0, 0), (3, 5)), ((3, 0), (2, 5))], True),  # uneven split of a (5, 5) tensor
        ([((0, 0), (3, 5)), ((2, 0), (3, 5))], False),  # rows overlap (and one row missing)
        ([((0, 0), (3, 5)), ((3, 0), (2, 4))], False),  # one column missing
        ([((0, 0), (3, 5)), ((3, 0), (3, 5))], False),  # out of bounds
    ])
    def test_irregular_grid(self, chunks, ok):
        meta = [[ShardedTensor("u", None, torch.float32, shape, (5, 5), off, None)]
                for off, shape in chunks]
        if ok:
            validate_sharding_integrity(meta)
        else:
            with pytest.raises(CheckpointingException):
                validate_sharding_integrity(meta)

    def test_objects_only(self):
        meta = INVALID["objects_missing"](mapping) + [[ShardedTensor.from_rank_offsets(
            "w", torch.zeros(2), (0, 0, 2))]]  # the tensor gap is ignored here
        with pytest.raises(CheckpointingException, match="missing"):
            validate_objects_sharding_integrity(meta)
        validate_objects_sharding_integrity(VALID["tp_dp"](mapping))

    def test_determine_global_metadata_single_process(self):
        sd = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)), "b": [ShardedObject(
            "o", 1, (1,), (0,))], "c": 5}
        local, global_ = determine_global_metadata({k: v for k, v in sd.items() if k != "c"})
        assert [x.key for x in local] == ["a", "o"] and all(x.data is None for x in local)
        assert global_ == [local]
        assert sd["a"].data is not None
        validate_sharding_integrity(global_, common_state_dict={"c": 5})


class TestStrictLoad:
    def _request(self):
        return {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "b": [ShardedTensor.from_rank_offsets("b", torch.ones(2))],
            "o": ShardedObject("o", None, (1,), (0,)),
        }

    def _ckpt(self):  # the checkpoint holds "a", "o" and "z"; "b" is unexpected, "z" missing
        return {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)).without_data(),
                "o/shard_0_1": ShardedObject("o", None, (1,), (0,)),
                "z": ShardedTensor.from_rank_offsets("z", torch.ones(2)).without_data()}

    def _run(self, strict, **kw):
        sd = self._request()
        _, global_meta = determine_global_metadata(sd)
        return validate_integrity_and_strict_load(
            sd, parse_strict_flag(strict), False, global_metadata=global_meta,
            ckpt_sharded_metadata=self._ckpt(), **kw)

    @pytest.mark.parametrize("strict, missing, unexpected", [
        ("log_unexpected", set(), {"b"}),
        ("log_all", {"z"}, {"b"}),
        ("return_unexpected", set(), {"b"}),
        ("return_all", {"z"}, {"b"}),
        ("ignore_all", set(), set()),
    ])
    def test_mismatch_keys(self, strict, missing, unexpected):
        sd, got_missing, got_unexpected = self._run(strict)
        assert (got_missing, got_unexpected) == (missing, unexpected)
        assert set(sd) == {"a", "o"}  # the unexpected key is dropped from the request

    def test_raise(self):
        with pytest.raises(CheckpointingException, match="Unexpected keys"):
            self._run("raise_unexpected")
        with pytest.raises(CheckpointingException, match="Missing keys .*'z'"):
            self._run("raise_all")

    def test_log(self, caplog):
        with caplog.at_level(logging.WARNING, logger=validation.__name__):
            self._run("log_all")
        assert "Missing keys (for all ranks): {'z'}" in caplog.text
        assert "Unexpected keys (for this rank): {'b'}" in caplog.text

    def test_assume_ok_and_requirements(self):
        sd = self._request()
        assert validate_integrity_and_strict_load(
            sd, StrictHandling.ASSUME_OK_UNEXPECTED, False) == (sd, set(), set())
        with pytest.raises(CheckpointingException, match="ckpt_sharded_metadata"):
            validate_integrity_and_strict_load(sd, StrictHandling.LOG_ALL, False)
        with pytest.raises(CheckpointingException, match="global_metadata"):
            validate_integrity_and_strict_load(sd, StrictHandling.ASSUME_OK_UNEXPECTED, True)

    def test_access_integrity_checked(self):
        bad = INVALID["overlap_tensor"](mapping)
        with pytest.raises(CheckpointingException):
            validate_integrity_and_strict_load(
                {}, StrictHandling.ASSUME_OK_UNEXPECTED, True, global_metadata=bad)

    def test_parse_and_flags(self):
        assert parse_strict_flag("raise_all") is StrictHandling.RAISE_ALL
        assert parse_strict_flag(StrictHandling.LOG_ALL) is StrictHandling.LOG_ALL
        with pytest.raises(ValueError, match="Invalid strict flag"):
            parse_strict_flag("strict")
        needs_global = {s for s in StrictHandling if StrictHandling.requires_global_app_metadata(s)}
        assert needs_global == {StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL,
                                StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL}
        assert not StrictHandling.requires_explicit_ckpt_mismatch_check(
            StrictHandling.ASSUME_OK_UNEXPECTED)
        returning = {s for s in StrictHandling
                     if StrictHandling.requires_returning_mismatch_keys(s)}
        assert returning == {StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL}


class _FakeStrategy:
    def __init__(self, backend, version=1, objects=False):
        self.backend, self.version, self.can_handle_sharded_objects = backend, version, objects

    def check_backend_compatibility(self, backend):
        if backend != self.backend:
            raise CheckpointingException(f"backend {backend}")

    def check_version_compatibility(self, version):
        if version != self.version:
            raise CheckpointingException(f"version {version}")


class TestVerifyCheckpoint:
    def test_not_a_checkpoint(self, tmp_path):
        with pytest.raises(CheckpointingException, match="does not exist"):
            validation.verify_checkpoint_and_load_strategy(str(tmp_path / "nope"))
        with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
            validation.verify_checkpoint_and_load_strategy(str(tmp_path))

    def test_given_strategies_are_checked(self, tmp_path):
        save_config(CheckpointingConfig("torch_dist"), str(tmp_path))
        sharded, common = _FakeStrategy("torch_dist"), _FakeStrategy("torch")
        assert validation.verify_checkpoint_and_load_strategy(
            str(tmp_path), sharded, common) == (sharded, common)
        with pytest.raises(CheckpointingException, match="backend torch_dist"):
            validation.verify_checkpoint_and_load_strategy(
                str(tmp_path), _FakeStrategy("zarr"), common)
        with pytest.raises(CheckpointingException, match="version 1"):
            validation.verify_checkpoint_and_load_strategy(
                str(tmp_path), sharded, _FakeStrategy("torch", version=2))

    def test_default_strategies(self, tmp_path):
        pytest.importorskip("ckpt_tool.dist_checkpointing.strategies.torch")
        save_config(CheckpointingConfig("torch_dist"), str(tmp_path))
        sharded, common = validation.verify_checkpoint_and_load_strategy(str(tmp_path))
        sharded.check_backend_compatibility("torch_dist")
        common.check_backend_compatibility("torch")

    def test_sharded_objects_handling(self):
        validation.validate_sharded_objects_handling(
            _FakeStrategy("a", objects=True), _FakeStrategy("b"))
        with pytest.raises(CheckpointingException, match="ShardedObjects"):
            validation.validate_sharded_objects_handling(_FakeStrategy("a"), _FakeStrategy("b"))


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-process gloo group (MCore's validation needs an initialised process group)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def mc():
    mmapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    mvalidation = pytest.importorskip("megatron.core.dist_checkpointing.validation")
    return mmapping, mvalidation


@pytest.mark.interop
class TestAgainstMegatronCore:
    @staticmethod
    def _outcome(fn, meta):
        try:
            fn(meta)
        except Exception as e:  # MCore raises its own exception class, or AssertionError
            return f"raises {type(e).__name__}: {e}"
        return "passes"

    @pytest.mark.parametrize("name", sorted(VALID) + sorted(INVALID))
    def test_same_verdict(self, mc, single_rank_group, name):
        mmapping, mvalidation = mc
        builder = {**VALID, **INVALID}[name]
        ours = self._outcome(validate_sharding_integrity, builder(mapping))
        theirs = self._outcome(mvalidation.validate_sharding_integrity, builder(mmapping))
        assert (ours == "passes") == (theirs == "passes"), (ours, theirs)
        assert (ours == "passes") == (name in VALID)

    def test_determine_global_metadata(self, mc, single_rank_group):
        mmapping, mvalidation = mc

        def sd(m):
            return {"a": m.ShardedTensor.from_rank_offsets("a", torch.ones(2, 2), (1, 0, 2)),
                    "b": [m.ShardedObject("o", 3, (2,), (1,), replica_id=1)]}

        ours_local, ours_global = determine_global_metadata(sd(mapping))
        their_local, their_global = mvalidation.determine_global_metadata(sd(mmapping))
        assert len(ours_global) == len(their_global) == 1
        for a, b in zip(ours_local, their_local):
            assert a.without_data().data is None and b.data is None
            assert (a.key, a.global_shape, a.global_offset, a.replica_id) == (
                b.key, b.global_shape, b.global_offset, b.replica_id)

    def test_strict_flags_match(self, mc):
        _, mvalidation = mc
        assert [s.value for s in StrictHandling] == [s.value for s in mvalidation.StrictHandling]
        for s in StrictHandling:
            theirs = mvalidation.StrictHandling(s.value)
            for check in ("requires_explicit_ckpt_mismatch_check", "requires_global_app_metadata",
                          "requires_returning_mismatch_keys"):
                assert getattr(StrictHandling, check)(s) == getattr(
                    mvalidation.StrictHandling, check)(theirs)

    @pytest.mark.parametrize("strict", [s.value for s in StrictHandling])
    def test_strict_load_same_result(self, mc, strict):
        mmapping, mvalidation = mc

        def run(m, v):
            request = {"a": m.ShardedTensor.from_rank_offsets("a", torch.ones(2)),
                       "b": [m.ShardedTensor.from_rank_offsets("b", torch.ones(2))],
                       "o": m.ShardedObject("o", None, (1,), (0,))}
            ckpt = {"a": m.ShardedTensor.from_rank_offsets("a", torch.ones(2)).without_data(),
                    "z": m.ShardedObject("z", None, (1,), (0,))}
            local = [x.without_data() for x in (request["a"], request["b"][0], request["o"])]
            try:
                sd, missing, unexpected = v.validate_integrity_and_strict_load(
                    request, v.parse_strict_flag(strict), False, local_metadata=local,
                    global_metadata=[local], ckpt_sharded_metadata=ckpt)
            except Exception as e:  # each library raises its own CheckpointingException
                return "raised", type(e).__name__
            return sorted(sd), missing, unexpected

        assert run(mapping, validation) == run(mmapping, mvalidation)
