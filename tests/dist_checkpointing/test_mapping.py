"""ShardedTensor / ShardedObject / factories: behaviour, and equality with Megatron-Core."""

from __future__ import annotations

import pytest
import torch

from ckpt_tool.dist_checkpointing import core
from ckpt_tool.dist_checkpointing.mapping import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)


@pytest.fixture(scope="module")
def mc():
    """Megatron-Core's mapping module (the reference implementation)."""
    return pytest.importorskip("megatron.core.dist_checkpointing.mapping")


# (local shape, rank offsets, prepend_axis_num, replica_id)
LAYOUT_CASES = [
    ((4, 6), (), 0, 0),
    ((4, 6), ((0, 1, 2),), 0, 0),
    ((4, 6), ((1, 2, 3),), 0, (0, 1, 0)),
    ((4, 6), ((0, 1, 2), (1, 0, 4)), 0, (0, 0, 3)),
    ((4, 6), ((0, 2, 3), (2, 1, 2)), 1, 0),  # stacked-layer axis + TP on dim 1
    ((5,), ((0, 3, 4), (1, 1, 2)), 1, (1, 0)),  # layer axis + vocab split
    ((2, 3), ((0, 1, 2), (1, 5, 8), (3, 0, 3)), 2, 0),  # expert + layer axes
    ((7, 1), ((1, 0, 1),), 0, 2),
]


def _st(shape, offsets, prepend, replica, key="w", dtype=torch.float32, **kw):
    data = torch.arange(int(torch.tensor(shape).prod()), dtype=dtype).reshape(shape)
    return ShardedTensor.from_rank_offsets(
        key, data, *offsets, replica_id=replica, prepend_axis_num=prepend, **kw
    )


class TestFromRankOffsets:
    def test_tp_split(self):
        t = _st((4, 6), ((0, 1, 2),), 0, 0)
        assert t.global_shape == (8, 6)
        assert t.global_offset == (4, 0)
        assert t.axis_fragmentations == (2, 1)
        assert t.local_shape == (4, 6)
        assert t.dtype == torch.float32
        assert t.has_regular_grid

    def test_prepend_axis(self):
        t = _st((4, 6), ((0, 2, 3), (2, 1, 2)), 1, 0)
        assert t.global_shape == (3, 4, 12)
        assert t.global_offset == (2, 0, 6)
        assert t.axis_fragmentations == (3, 1, 2)
        assert t.global_slice() == (2, slice(0, 4), slice(6, 12))
        assert t.local_chunk_offset_in_global() == (2, 0, 1)
        assert t.max_allowed_chunks() == (1, 4, 6)

    @pytest.mark.parametrize(
        "offsets", [((0, 2, 2),), ((-1, 0, 2),), ((0, 0, 0),), ((0, -1, 2),), ((2, 0, 2),)]
    )
    def test_invalid_offsets(self, offsets):
        with pytest.raises(CheckpointingException):
            _st((4, 6), offsets, 0, 0)

    def test_rejects_flattened_range(self):
        with pytest.raises(ValueError, match="from_rank_offsets_flat"):
            ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))

    def test_init_kwargs(self):
        t = _st((3,), ((0, 1, 2),), 0, 0, allow_shape_mismatch=True)
        assert t.allow_shape_mismatch


class TestValidation:
    def test_dtype_mismatch(self):
        with pytest.raises(CheckpointingException, match="dtype"):
            ShardedTensor("w", torch.zeros(2), torch.float16, (2,), (2,), (0,), (1,))

    def test_shape_mismatch(self):
        with pytest.raises(CheckpointingException, match="shape"):
            ShardedTensor("w", torch.zeros(2), torch.float32, (3,), (3,), (0,), (1,))

    def test_offset_dims(self):
        with pytest.raises(CheckpointingException, match="offset dimensions"):
            ShardedTensor("w", None, torch.float32, (2,), (4,), (0, 0), (2,))

    def test_prepend_dims(self):
        with pytest.raises(CheckpointingException, match="prepend_axis_num"):
            ShardedTensor("w", None, torch.float32, (2,), (4, 2), (0, 0), (1, 1))

    def test_offset_not_divisible(self):
        with pytest.raises(CheckpointingException, match="divisible"):
            ShardedTensor("w", None, torch.float32, (2,), (4,), (1,), (2,))
        # irregular grids (no axis_fragmentations) may start anywhere
        t = ShardedTensor("w", None, torch.float32, (2,), (5,), (1,), None)
        assert not t.has_regular_grid

    def test_max_allowed_chunks_divisibility(self):
        t = ShardedTensor("w", None, torch.float32, (2,), (5,), (0,), (2,))
        with pytest.raises(CheckpointingException, match="divisible"):
            t.max_allowed_chunks()
        t.allow_shape_mismatch = True
        assert t.max_allowed_chunks() == (2,)


class TestDataHandling:
    def test_without_data_and_init_data(self):
        t = _st((2, 3), ((1, 1, 2),), 0, 0)
        meta = t.without_data()
        assert meta.data is None and t.data is not None
        assert (meta.key, meta.global_shape, meta.global_offset) == (
            t.key, t.global_shape, t.global_offset)
        meta.init_data("cpu", init_fn=torch.ones)
        assert meta.data.shape == (2, 3) and meta.data.dtype == t.dtype
        assert torch.all(meta.data == 1)
        before = meta.data
        meta.init_data("cpu")  # no-op when data exists
        assert meta.data is before

    def test_narrow(self):
        t = _st((4, 6), ((0, 1, 2),), 1, 0)  # global (2, 4, 6), layer 1
        (n,) = t.narrow(1, 2, 3)
        assert n.local_shape == (4, 3)
        assert n.global_shape == (2, 4, 3)
        assert n.global_offset == (1, 0, 0)
        assert torch.equal(n.data, t.data[:, 2:5])
        t2 = _st((4, 6), ((1, 1, 2),), 0, 0)  # global (4, 12), offset 6
        (n2,) = t2.narrow(1, 0, 3)
        assert (n2.global_shape, n2.global_offset) == ((4, 6), (0, 3))

    def test_str_names_key_and_layout(self):
        text = str(_st((4, 6), ((0, 1, 2),), 0, 0, key="decoder.w"))
        assert "decoder.w" in text and "(8, 6)" in text


class TestFlattened:
    def _flat(self, rng=slice(5, 10)):
        data = torch.arange(rng.stop - rng.start, dtype=torch.float32)
        return ShardedTensor.from_rank_offsets_flat(
            "f", data, (3, 4), (0, 1, 2), flattened_range=rng
        )

    def test_layout_like_non_flat(self):
        t = self._flat()
        assert t.global_shape == (6, 4) and t.global_offset == (3, 0)
        assert t.local_shape == (3, 4) and t.flattened_range == slice(5, 10)

    def test_constructor_errors(self):
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets_flat("f", torch.zeros(5), (3, 4))
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets_flat(
                "f", torch.zeros(5, 1), (3, 4), flattened_range=slice(0, 5))
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets_flat(
                "f", torch.zeros(4), (3, 4), flattened_range=slice(0, 5))
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets_flat(
                "f", torch.zeros(5), (3, 4), flattened_range=slice(10, 15))

    def test_coordinates(self):
        t = self._flat()
        rows, cols = t.local_coordinates()
        assert rows.tolist() == [1, 1, 1, 2, 2] and cols.tolist() == [1, 2, 3, 0, 1]
        grows, gcols = t.global_coordinates()
        assert grows.tolist() == [4, 4, 4, 5, 5] and gcols.tolist() == cols.tolist()
        with pytest.raises(CheckpointingException):
            _st((3, 4), (), 0, 0).local_coordinates()

    def test_init_data_slices(self):
        t = self._flat().without_data()
        t.init_data("cpu", init_fn=lambda shape, **kw: torch.arange(12.0).reshape(shape))
        assert t.data.tolist() == [5.0, 6.0, 7.0, 8.0, 9.0]

    def test_narrow(self):
        t = self._flat()  # elements 5..9 of a 3x4 piece
        (n,) = t.narrow(0, 1, 1)  # row 1 = elements 4..7
        assert n.flattened_range == slice(1, 4)
        assert n.local_shape == (1, 4) and n.global_shape == (2, 4) and n.global_offset == (1, 0)
        assert n.data.tolist() == [0.0, 1.0, 2.0]
        assert t.narrow(0, 0, 1) == []  # row 0 = elements 0..3: no overlap
        with pytest.raises(CheckpointingException):
            t.narrow(1, 0, 2)


class TestShardedObject:
    def test_unique_key_round_trip(self):
        obj = ShardedObject("rng_state", {"a": 1}, (2, 4), (1, 3), replica_id=(0, 1))
        assert obj.unique_key == "rng_state/shard_1.3_2.4"
        back = ShardedObject.empty_from_unique_key(obj.unique_key, replica_id=5)
        assert (back.key, back.global_shape, back.global_offset, back.replica_id, back.data) == (
            "rng_state", (2, 4), (1, 3), 5, None)
        assert str(obj) == "ShardedObject(key='rng_state')"

    def test_key_with_slash_and_legacy_shape(self):
        back = ShardedObject.empty_from_unique_key("a/b/shard_0.1_2")
        assert back.key == "a/b" and back.global_offset == (0, 1) and back.global_shape == (2, -1)

    @pytest.mark.parametrize("bad", ["no_slash", "k/chunk_0_1", "k/shard_x_1"])
    def test_bad_unique_key(self, bad):
        with pytest.raises(CheckpointingException):
            ShardedObject.empty_from_unique_key(bad)

    def test_validation(self):
        with pytest.raises(CheckpointingException):
            ShardedObject("k", None, (2,), (0, 0))
        assert ShardedObject("k", 5, (1,), (0,)).without_data().data is None


def test_is_main_replica():
    assert is_main_replica(0) and is_main_replica((0, 0, 0)) and is_main_replica(())
    assert not is_main_replica(1) and not is_main_replica((0, 1))


def test_exception_is_shared():
    assert CheckpointingException is core.CheckpointingException
    assert issubclass(CheckpointingException, Exception)
    assert "boom" in str(CheckpointingException("boom"))


def _split_factory(key="w", data=None):
    """Factory saving a tensor as two halves (like SwiGLU's W/V split)."""
    data = torch.arange(8.0).reshape(4, 2) if data is None else data

    def build(key, t, replica_id, flattened_range):
        a, b = t.chunk(2)
        return {
            "a": ShardedTensor.from_rank_offsets(f"{key}.a", a, replica_id=replica_id),
            "b": ShardedTensor.from_rank_offsets(f"{key}.b", b, replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    return ShardedTensorFactory(key, data, build, merge)


class TestFactories:
    def test_build_and_merge(self):
        sd = {"layer": [_split_factory(), LocalNonpersistentObject(3)], "x": 1}
        apply_factories(sd)
        built = sd["layer"][0]
        assert set(built) == {"a", "b"} and built["a"].key == "w.a"
        loaded = {"layer": [{"a": torch.zeros(2, 2), "b": torch.ones(2, 2)}, 3], "x": 1}
        merged = apply_factory_merges(loaded, {"layer": {0: _split_factory()}})
        assert merged is loaded
        assert torch.equal(loaded["layer"][0], torch.cat([torch.zeros(2, 2), torch.ones(2, 2)]))
        assert sd["layer"][1].unwrap() == 3

    def test_without_data(self):
        f = _split_factory()
        assert f.without_data().data is None and f.data is not None
        f.validate_metadata_integrity()

    @pytest.mark.parametrize(
        "x1, x2",
        [
            ({"a": 1}, {"b": _split_factory()}),
            ([1, 2], [_split_factory()]),
            ([1], {"k": _split_factory()}),
            ([1], {3: _split_factory()}),
            (1, 2),
        ],
    )
    def test_merge_errors(self, x1, x2):
        with pytest.raises(ValueError):
            apply_factory_merges(x1, x2)


@pytest.mark.interop
class TestAgainstMegatronCore:
    @pytest.mark.parametrize("shape, offsets, prepend, replica", LAYOUT_CASES)
    def test_from_rank_offsets(self, mc, shape, offsets, prepend, replica):
        ours = _st(shape, offsets, prepend, replica)
        theirs = mc.ShardedTensor.from_rank_offsets(
            "w", ours.data.clone(), *offsets, replica_id=replica, prepend_axis_num=prepend
        )
        for attr in ("key", "dtype", "local_shape", "global_shape", "global_offset",
                     "axis_fragmentations", "replica_id", "prepend_axis_num",
                     "allow_shape_mismatch", "flattened_range", "has_regular_grid"):
            assert getattr(ours, attr) == getattr(theirs, attr), attr
        for method in ("global_slice", "local_chunk_offset_in_global", "max_allowed_chunks"):
            assert getattr(ours, method)() == getattr(theirs, method)(), method
        assert ours.without_data().global_offset == theirs.without_data().global_offset
        assert is_main_replica(replica) == mc.is_main_replica(replica)

    @pytest.mark.parametrize("shape, offsets, prepend, replica", LAYOUT_CASES)
    def test_flat_layout_matches_non_flat(self, mc, shape, offsets, prepend, replica):
        # MCore 0.16 dropped flattened_range; the layout must still be MCore's non-flat one.
        numel = int(torch.tensor(shape).prod())
        rng = slice(numel // 3, numel)
        ours = ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(numel - numel // 3), shape, *offsets, flattened_range=rng,
            replica_id=replica, prepend_axis_num=prepend,
        )
        theirs = mc.ShardedTensor.from_rank_offsets(
            "w", torch.zeros(shape), *offsets, replica_id=replica, prepend_axis_num=prepend
        )
        for attr in ("local_shape", "global_shape", "global_offset", "axis_fragmentations"):
            assert tuple(getattr(ours, attr)) == tuple(getattr(theirs, attr)), attr
        assert ours.local_chunk_offset_in_global() == theirs.local_chunk_offset_in_global()
        assert ours.max_allowed_chunks() == theirs.max_allowed_chunks()

    @pytest.mark.parametrize("offsets", [((0, 2, 2),), ((-1, 0, 2),), ((0, 0, 0),)])
    def test_same_invalid_offsets(self, mc, offsets):
        with pytest.raises(mc.CheckpointingException):
            mc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), *offsets)
        with pytest.raises(CheckpointingException):
            ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), *offsets)

    def test_narrow(self, mc):
        data = torch.arange(24.0).reshape(4, 6)
        ours = ShardedTensor.from_rank_offsets("w", data, (0, 1, 3), (2, 1, 2), prepend_axis_num=1)
        theirs = mc.ShardedTensor.from_rank_offsets(
            "w", data, (0, 1, 3), (2, 1, 2), prepend_axis_num=1)
        for dim, start, length in [(0, 1, 2), (1, 0, 3), (1, 3, 3)]:
            (a,), (b,) = ours.narrow(dim, start, length), theirs.narrow(dim, start, length)
            assert (tuple(a.local_shape), a.global_shape, a.global_offset) == (
                tuple(b.local_shape), b.global_shape, b.global_offset)
            assert torch.equal(a.data, b.data)

    @pytest.mark.parametrize(
        "shape, offset", [((1,), (0,)), ((2, 4), (1, 3)), ((3, 1, 2), (2, 0, 1))])
    def test_sharded_object(self, mc, shape, offset):
        ours = ShardedObject("rng_state", None, shape, offset)
        theirs = mc.ShardedObject("rng_state", None, shape, offset)
        assert ours.unique_key == theirs.unique_key
        a = ShardedObject.empty_from_unique_key(ours.unique_key)
        b = mc.ShardedObject.empty_from_unique_key(theirs.unique_key)
        assert (a.key, a.global_shape, a.global_offset) == (b.key, b.global_shape, b.global_offset)
        assert str(ours) == str(theirs)

    def test_factory_merges(self, mc):
        def make(cls):
            return cls("w", torch.zeros(2), lambda *a: {}, lambda sub: sum(sub.values()))

        def loaded():
            return {"m": [{"x": 1, "y": 2}, 5], "n": {"z": 0}}

        x2_ours = {"m": {0: make(ShardedTensorFactory)}}
        x2_theirs = {"m": {0: make(mc.ShardedTensorFactory)}}
        assert apply_factory_merges(loaded(), x2_ours) == mc.apply_factory_merges(
            loaded(), x2_theirs)
