"""Megatron-Core's building blocks of the torch_dist strategy: PyT state dicts, planners, reader.

A PyT state dict made by ``mcore_to_pyt_state_dict`` is saved and loaded by plain
``torch.distributed.checkpoint`` with our MCoreSavePlanner/MCoreLoadPlanner, and the files are
checked against our own TorchDistLoadShardedStrategy (and the reverse).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan

from ckpt_tool.dist_checkpointing import ShardedObject, ShardedTensor
from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.strategies import torch as st
from ckpt_tool.dist_checkpointing.strategies._pyt_state_dict import _unwrap_pyt_sharded_tensor

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GLOBAL = torch.arange(24, dtype=torch.float32).reshape(4, 6)


pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")]


def _request(fill=None) -> dict:
    """Both row halves of GLOBAL ("w", two local pieces), a 1-D "v" and an object."""
    def piece(rows):
        return GLOBAL[rows].clone() if fill is None else torch.full((2, 6), fill)
    return {
        "w": [ShardedTensor.from_rank_offsets("w", piece(slice(0, 2)), (0, 0, 2)),
              ShardedTensor.from_rank_offsets("w", piece(slice(2, 4)), (0, 1, 2))],
        "v": [ShardedTensor.from_rank_offsets(
            "v", GLOBAL[0].clone() if fill is None else torch.full((6,), fill))],
        "o/shard_0_1": [ShardedObject("o", None if fill is not None else {"step": 7}, (1,), (0,))],
    }


def _save_pyt(ckpt: Path, request: dict) -> Metadata:
    pyt = st.mcore_to_pyt_state_dict(request)
    return dcp.save(pyt, checkpoint_id=str(ckpt), no_dist=True,
                    planner=st.MCoreSavePlanner(flatten_state_dict=False))


def _load_pyt(ckpt: Path, request: dict, **planner_kwargs) -> dict:
    pyt = st.mcore_to_pyt_state_dict(request, is_loading=True)
    dcp.load(pyt, storage_reader=st.CachedMetadataFileSystemReader(str(ckpt)), no_dist=True,
             planner=st.MCoreLoadPlanner(**planner_kwargs))
    return {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}


def test_flatten_state_dict_keeps_sharded_values_whole_and_inverts():
    a = ShardedTensor.from_rank_offsets("a", torch.ones(2))
    obj = ShardedObject("o", 1, (1,), (0,))
    nested = {"x": {"y": a, 3: [obj, torch.zeros(1)]}, "z": 5}
    flat, mapping = st.flatten_state_dict(nested)
    assert flat == {"x.y": a, "x.3.0": obj, "x.3.1": flat["x.3.1"], "z": 5}
    assert mapping["x.3.0"] == ("x", "3", 0)
    assert unflatten_state_dict(flat, mapping)["x"]["3"][0] is obj
    with pytest.raises(ValueError, match="duplicated flatten key a.b"):
        st.flatten_state_dict({"a.b": 1, "a": {"b": 2}})


def test_conversion_types_and_side_effects():
    request = _request()
    pyt = st.mcore_to_pyt_state_dict(request)
    assert isinstance(pyt["w"], st.LocalShardsContainer)
    assert isinstance(pyt["v"], st.CheckpointableShardedTensor)
    assert pyt["w"].shape == (4, 6) and pyt["w"].dtype == torch.float32
    assert torch.load(pyt["o/shard_0_1"]) == [{"step": 7}]
    with pytest.raises(NotImplementedError, match="shouldn't be used with Tensor operations"):
        pyt["v"] + 1
    with pytest.raises(CheckpointingException, match="`data` attr is None"):
        st.mcore_to_pyt_state_dict({"v": [ShardedTensor.from_rank_offsets(
            "v", torch.ones(2)).without_data()]})
    # loading allocates missing data, zeroes shape-mismatch tensors
    missing = ShardedTensor.from_rank_offsets("m", torch.ones(3)).without_data()
    padded = ShardedTensor.from_rank_offsets("p", torch.ones(3), allow_shape_mismatch=True)
    st.mcore_to_pyt_state_dict({"m": [missing], "p": [padded]}, is_loading=True)
    assert missing.data.shape == (3,) and torch.equal(padded.data, torch.zeros(3))


def test_local_shards_container_lookup():
    pyt = st.mcore_to_pyt_state_dict(_request())
    container = pyt["w"]
    second = container.__get_tensor_shard__(MetadataIndex("w", torch.Size([2, 0]), index=0))
    assert torch.equal(second, GLOBAL[2:])  # wrong index hint: found by offset
    assert [i.index.index for i in container.__create_write_items__("w", container)] == [0, 1]
    assert [tuple(c.offsets) for c in container.__create_chunk_list__()] == [(0, 0), (2, 0)]
    with pytest.raises(ValueError, match="Could not find shard"):
        container.__get_tensor_shard__(MetadataIndex("w", torch.Size([1, 0])))
    with pytest.raises(ValueError, match="without an offset"):
        container.__get_tensor_shard__(MetadataIndex("w"))


def test_dcp_round_trip_without_process_group(tmp_path):
    md = _save_pyt(tmp_path, _request())
    assert set(md.state_dict_metadata) == {"w", "v", "o/shard_0_1"}
    request = _request(fill=-1.0)
    loaded = _load_pyt(tmp_path, request, shapes_validation_sharded_tensors=request["w"])
    assert torch.equal(request["w"][0].data, GLOBAL[:2])  # loaded into the given data
    assert torch.equal(loaded["w"][1], GLOBAL[2:]) and torch.equal(loaded["v"][0], GLOBAL[0])
    assert loaded["o/shard_0_1"] == [{"step": 7}]


def test_our_strategy_reads_pyt_saves_and_the_reverse(tmp_path):
    _save_pyt(tmp_path / "pyt", _request())
    theirs = st.TorchDistLoadShardedStrategy().load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (1, 1, 2)),
         "o": ShardedObject("o", None, (1,), (0,))}, tmp_path / "pyt")
    assert torch.equal(theirs["w"], GLOBAL[:, 3:]) and theirs["o"] == {"step": 7}

    st.TorchDistSaveShardedStrategy("torch_dist", 1).save(
        {"w": ShardedTensor.from_rank_offsets("w", GLOBAL.clone())}, tmp_path / "ours")
    request = _request(fill=0.0)
    loaded = _load_pyt(tmp_path / "ours", {"w": request["w"]})
    assert torch.equal(torch.cat(loaded["w"]), GLOBAL)


def test_load_planner_checks_global_shapes(tmp_path):
    _save_pyt(tmp_path, {"e": [ShardedTensor.from_rank_offsets("e", GLOBAL.clone())]})
    metadata = st.CachedMetadataFileSystemReader(str(tmp_path)).read_metadata()

    def plan(sh_ten, **kwargs):
        planner = st.MCoreLoadPlanner(**kwargs)
        planner.set_up_planner(st.mcore_to_pyt_state_dict({sh_ten.key: [sh_ten]}, True), metadata)
        return planner.create_local_plan()

    taller = ShardedTensor.from_rank_offsets("e", torch.zeros(5, 6))
    with pytest.raises(CheckpointingException, match="Global shape mismatch"):
        plan(taller, shapes_validation_sharded_tensors=[taller])
    absent = ShardedTensor.from_rank_offsets("nope", torch.zeros(4, 6))
    with pytest.raises(KeyError, match="nope from model not in state dict"):
        plan(absent, shapes_validation_sharded_tensors=[absent])

    padded = ShardedTensor.from_rank_offsets("e", torch.full((5, 6), 9.0),
                                             allow_shape_mismatch=True)
    loaded = _load_pyt(tmp_path, {"e": [padded]},
                       allow_shape_mismatch_sharded_tensors={"e": padded})
    assert torch.equal(loaded["e"][0][:4], GLOBAL) and not loaded["e"][0][4].any()
    assert metadata.state_dict_metadata["e"].size == (4, 6)  # restored after planning


def test_strategy_load_reads_the_plan_of_mcore_load_planner(tmp_path):
    """Our strategy's load reads what ``MCoreLoadPlanner.create_local_plan`` plans, as
    Megatron-Core's does (Megatron-LM's test_fully_parallel patches it to watch the reads);
    requests of one key with equal offsets are read once."""
    st.TorchDistSaveShardedStrategy("torch_dist", 1).save(
        {"w": ShardedTensor.from_rank_offsets("w", GLOBAL.clone()),
         "o": ShardedObject("o", {"step": 7}, (1,), (0,))}, tmp_path)
    original, seen = st.MCoreLoadPlanner.create_local_plan, []

    def request():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 6), -1.0), (0, 1, 2)),
                "tied": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, 1, 2)),
                "o": ShardedObject("o", None, (1,), (0,))}

    def without_tensor_reads(self):  # the plan, less its reads of "w"
        plan = original(self)
        seen.append((self, plan))
        return LoadPlan([item for item in plan.items if item.dest_index.fqn != "w"])

    with mock.patch.object(st.MCoreLoadPlanner, "create_local_plan", without_tensor_reads):
        loaded = st.TorchDistLoadShardedStrategy().load(request(), tmp_path)
    (planner, plan), = seen
    assert [sh.key for sh in planner.shapes_validation_sharded_tensors] == ["w"]
    assert not planner.allow_shape_mismatch_sharded_tensors
    (read,) = [item for item in plan.items if item.dest_index.fqn == "w"]
    assert (tuple(read.storage_offsets), tuple(read.lengths)) == ((2, 0), (2, 6))
    assert loaded["o"] == {"step": 7}
    assert (loaded["w"] == -1).all()  # nothing read, and the shared read copied that
    assert (loaded["tied"] == -1).all()

    loaded = st.TorchDistLoadShardedStrategy().load(request(), tmp_path)
    assert torch.equal(loaded["w"], GLOBAL[2:]) and torch.equal(loaded["tied"], GLOBAL[2:])


def test_save_planner_arguments_and_decentralized_plan():
    with pytest.raises(ValueError, match="flatten_state_dict=True"):
        st.MCoreSavePlanner()
    with pytest.raises(ValueError, match="dedup_replicated_tensors=True"):
        st.MCoreSavePlanner(flatten_state_dict=False, dedup_replicated_tensors=True)
    assert not st.MCoreSavePlanner(can_run_decentralized_global_plan=False) \
        .can_run_decentralized_global_plan
    planner = st.MCoreSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(st.mcore_to_pyt_state_dict(_request()), is_coordinator=False)
    plan = planner.create_local_plan()
    # objects are written on every rank, not only on the coordinator
    assert sorted(i.index.fqn for i in plan.items) == ["o/shard_0_1", "v", "w", "w"]
    assert planner.create_decentralized_global_plan(plan) is plan
    buf = io.BytesIO(b"abc")
    assert planner.transform_object(plan.items[0], buf) is buf


def _stacked(fill=None) -> list:
    """Two layers stacked on a prepended axis, each cut in 2 along rows: 4 local pieces."""
    full = torch.arange(48, dtype=torch.float32).reshape(2, 4, 6)
    return [ShardedTensor.from_rank_offsets(
        "s", full[layer, 2 * tp:2 * tp + 2].clone() if fill is None else torch.full((2, 6), fill),
        (0, layer, 2), (1, tp, 2), prepend_axis_num=1)
        for layer in range(2) for tp in range(2)], full


def test_prepended_axes_become_torch_sharded_tensor(tmp_path, single_rank_group):
    pieces, full = _stacked()
    pyt = st.mcore_to_pyt_state_dict({"s": pieces})
    assert isinstance(pyt["s"], TorchShardedTensor) and pyt["s"].key == "s"
    assert pyt["s"].size() == (2, 4, 6) and pyt["s"].mcore_sh_ten.data is None
    md = dcp.save(pyt, checkpoint_id=str(tmp_path / "c"),
                  planner=st.MCoreSavePlanner(flatten_state_dict=False))
    assert len(md.state_dict_metadata["s"].chunks) == 4

    request, _ = _stacked(fill=-1.0)
    loaded = _load_pyt(tmp_path / "c", {"s": request})
    assert [tuple(t.shape) for t in loaded["s"]] == [(2, 6)] * 4
    assert torch.equal(request[3].data, full[1, 2:])
    ours = st.TorchDistLoadShardedStrategy().load(
        {"s": ShardedTensor.from_rank_offsets("s", torch.zeros(2, 4, 6))}, tmp_path / "c")
    assert torch.equal(ours["s"], full)

    direct = st.sharded_tensor_to_torch_sharded_tensor(_stacked()[0], rank=0)
    assert [tuple(s.metadata.shard_offsets) for s in direct.local_shards()] == \
        [(0, 0, 0), (0, 2, 0), (1, 0, 0), (1, 2, 0)]
    assert torch.equal(direct.local_shards()[3].tensor, full[1:, 2:])


def test_cached_reader_reads_metadata_once(tmp_path):
    _save_pyt(tmp_path, _request())
    reader = st.CachedMetadataFileSystemReader(str(tmp_path))
    first = reader.read_metadata()
    (tmp_path / ".metadata").unlink()
    assert reader.read_metadata() is first
    with pytest.raises(Exception, match="no .metadata file"):
        st.CachedMetadataFileSystemReader(str(tmp_path)).read_metadata()


def test_mcore015_metadata_classes_and_pickling():
    ckpt = FIXTURES / "mcore015_gpt_flattened_optim" / "iter_0000010"
    md = st.CachedMetadataFileSystemReader(str(ckpt)).read_metadata()
    assert isinstance(md, st.MCoreMetadata) and isinstance(md, Metadata)
    assert isinstance(md.all_local_plans[0], st.MCoreSavePlan) and md.mcore_data
    data = pickle.dumps(md)  # as the torch classes: loadable without ckpt_tool or megatron
    assert b"ckpt_tool" not in data and b"megatron" not in data
    again = pickle.loads(data)
    assert type(again) is Metadata and again.mcore_data == md.mcore_data
    strategy = st.TorchDistLoadShardedStrategy()
    assert {k: v.global_shape for k, v in
            strategy.load_tensors_metadata(ckpt, metadata=again).items()} == \
        {k: v.global_shape for k, v in strategy.load_tensors_metadata(ckpt).items()}
