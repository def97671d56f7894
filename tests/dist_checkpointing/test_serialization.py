"""Single-process save/load through the torch_dist backend (no process group needed)."""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tool import dist_checkpointing as dc
from ckpt_tool.dist_checkpointing import mapping, serialization
from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from ckpt_tool.dist_checkpointing.validation import StrictHandling

sys.path.insert(0, str(Path(__file__).parent / "_workers"))
import layouts  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _model(empty=False):
    return layouts.build_sharded_state_dict(mapping, layouts.Layout(1, 1, 1, 0), empty=empty)


@pytest.fixture()
def saved(tmp_path):
    sd = _model()
    sd.update(layouts.common_state())
    dc.save(sd, str(tmp_path))
    return tmp_path


def test_files_written(saved):
    names = sorted(os.listdir(saved))
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "integrity.json",
                     "metadata.json"]
    cfg = dc.core.maybe_load_config(str(saved))
    assert (cfg.sharded_backend, cfg.sharded_backend_version) == ("torch_dist", 1)
    assert (cfg.common_backend, cfg.common_backend_version) == ("torch", 1)


def test_round_trip(saved):
    full = layouts.global_tensors()
    out = dc.load(_model(empty=True), str(saved))
    layers = out["decoder"]["layers"]
    for i in range(layouts.NUM_LAYERS):
        for name in ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                     "mlp.linear_fc1.weight", "input_layernorm.weight"):
            got, want = layers[f"{i}.{name}"], full[f"decoder.layers.{name}"][i]
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert out["output_layer.weight"].dtype == torch.bfloat16
    assert torch.equal(out["output_layer.weight"], full["output_layer.weight"])
    assert torch.equal(out["step_counter"], full["step_counter"])
    assert out["rng_state"] == {"seed": 0, "tp": 0, "pp": 0}
    assert out["extra"] == {"note": "hello", "values": [1, 2, 3]}
    for k, v in layouts.common_state().items():
        assert out[k] == v


def test_loads_into_given_tensors(saved):
    target = _model(empty=True)
    buf = target["step_counter"].data
    out = dc.load(target, str(saved))
    assert out["step_counter"] is buf and buf.sum() == 15


def test_load_other_sharding(saved):
    """Request quarter chunks of a tensor saved whole (resharding within one process)."""
    full = layouts.global_tensors()["embedding.word_embeddings.weight"]
    req = {f"part{i}": ShardedTensor.from_rank_offsets(
        "embedding.word_embeddings.weight", torch.zeros(4, 8), (0, i, 4), replica_id=0)
        for i in range(4)}
    out = dc.load(req, str(saved), validate_access_integrity=False)
    for i in range(4):
        assert torch.equal(out[f"part{i}"], full[4 * i:4 * i + 4])


def test_metadata_queries(saved):
    meta = dc.load_tensors_metadata(str(saved))
    full = layouts.global_tensors()
    assert set(meta) == set(full)
    for k, v in full.items():
        assert meta[k].data is None and meta[k].dtype == v.dtype
        assert tuple(meta[k].global_shape) == tuple(v.shape)
    sharded = serialization.load_sharded_metadata(str(saved))
    assert {"rng_state/shard_0.0_1.1", "model_extra/shard_0_1"} <= set(sharded)
    assert isinstance(sharded["rng_state/shard_0.0_1.1"], ShardedObject)
    plain = dc.load_plain_tensors(str(saved))
    for k, v in full.items():
        assert torch.equal(plain[k], v)
    assert dc.load_common_state_dict(str(saved))["iteration"] == 10


def test_dcp_metadata_like_mcore(saved):
    """`.metadata` is DCP Metadata as MCore 0.16 writes it (plain torch reader can read it)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(saved)).read_metadata()
    assert md.planner_data is None
    assert len(md.all_local_plans) == 1
    assert md.storage_meta.checkpoint_id is not None
    qkv = md.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (4, 24, 8)
    assert sorted(tuple(c.offsets) for c in qkv.chunks) == [(i, 0, 0) for i in range(4)]
    assert all(tuple(c.sizes) == (1, 24, 8) for c in qkv.chunks)
    # objects: a list of the object payloads, as MCore serialises them
    idx = [k for k in md.storage_data if k.fqn == "rng_state/shard_0.0_1.1"][0]
    info = md.storage_data[idx]
    with open(saved / info.relative_path, "rb") as f:
        f.seek(info.offset)
        import io

        payload = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    assert payload == [{"seed": 0, "tp": 0, "pp": 0}]


def test_content_metadata_and_factories(tmp_path):
    data = torch.arange(12.0).reshape(3, 4)

    def build(key, t, replica_id, flattened_range):
        return {"a": ShardedTensor.from_rank_offsets(f"{key}.a", t[:1].clone(), replica_id=replica_id),
                "b": ShardedTensor.from_rank_offsets(f"{key}.b", t[1:].clone(), replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    sd = {"w": ShardedTensorFactory("w", data, build, merge), "x": 1}
    dc.save(sd, str(tmp_path), content_metadata={"format": "x", "v": 2})
    assert dc.load_content_metadata(str(tmp_path)) == {"format": "x", "v": 2}
    assert set(dc.load_tensors_metadata(str(tmp_path))) == {"w.a", "w.b"}
    out = dc.load({"w": ShardedTensorFactory("w", torch.zeros(3, 4), build, merge)}, str(tmp_path))
    assert torch.equal(out["w"], data) and out["x"] == 1


def test_shape_mismatch(saved):
    bad = {"e": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight",
                                                torch.zeros(20, 8))}
    with pytest.raises(CheckpointingException, match="Global shape mismatch"):
        dc.load(bad, str(saved))
    padded = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight",
                                             torch.full((20, 8), 7.0))
    padded.allow_shape_mismatch = True
    out = dc.load({"e": padded}, str(saved))
    full = layouts.global_tensors()["embedding.word_embeddings.weight"]
    assert torch.equal(out["e"][:16], full) and torch.all(out["e"][16:] == 0)


def test_shape_mismatch_into_a_parameter(saved):
    """Megatron-LM loads the padded embedding into a tensor of the model's state dict that may
    be the parameter itself (requires grad): as MCore, the load zeroes and fills its detached
    data in place and returns that (sharing the parameter's storage)."""
    param = torch.nn.Parameter(torch.full((20, 8), 7.0))
    padded = ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", param)
    padded.allow_shape_mismatch = True
    out = dc.load({"e": padded}, str(saved))
    full = layouts.global_tensors()["embedding.word_embeddings.weight"]
    assert not out["e"].requires_grad and out["e"].data_ptr() == param.data_ptr()
    assert torch.equal(param.detach()[:16], full) and torch.all(param.detach()[16:] == 0)


def test_missing_keys(saved):
    req = {"nope": ShardedTensor.from_rank_offsets("nope", torch.zeros(2))}
    with pytest.raises(CheckpointingException, match="nope"):
        dc.load(req, str(saved))
    obj = {"o": ShardedObject("rng_state", None, (2, 2), (1, 1))}
    with pytest.raises(CheckpointingException, match="rng_state/shard_1.1_2.2"):
        dc.load(obj, str(saved))
    req["ok"] = ShardedTensor.from_rank_offsets("step_counter", torch.zeros(2, 3, dtype=torch.int64))
    out, missing, unexpected = dc.load(req, str(saved), strict=StrictHandling.RETURN_UNEXPECTED)
    assert unexpected == {"nope"} and "nope" not in out and out["ok"].sum() == 15


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointingException):
        dc.load({}, str(tmp_path))


def test_async_request_and_defaults(tmp_path):
    from ckpt_tool.dist_checkpointing.strategies.torch import (
        TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy)

    assert isinstance(serialization.get_default_save_sharded_strategy(), TorchDistSaveShardedStrategy)
    sd = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(3))}
    req = dc.save(sd, str(tmp_path), async_sharded_save=True)
    assert not (tmp_path / "metadata.json").exists()
    req.execute_sync()
    assert (tmp_path / "metadata.json").exists()
    assert isinstance(serialization.get_default_load_sharded_strategy(str(tmp_path)),
                      TorchDistLoadShardedStrategy)
    assert torch.equal(dc.load_plain_tensors(str(tmp_path))["t"], torch.ones(3))


def test_thread_count_files(tmp_path):
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4,), float(i)))
          for i in range(5)}
    dc.save(sd, str(tmp_path), sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                             thread_count=3))
    assert sorted(p.name for p in tmp_path.glob("*.distcp")) == [f"__0_{i}.distcp" for i in range(3)]
    single = {"t": ShardedTensor.from_rank_offsets("t", torch.ones(2))}
    dc.save(single, str(tmp_path / "one") if (tmp_path / "one").mkdir() is None else None)
    assert [p.name for p in (tmp_path / "one").glob("*.distcp")] == ["__0_0.distcp"]


@pytest.mark.parametrize("async_save", [False, True])
def test_separation_hint_puts_matching_keys_in_files_of_their_own(tmp_path, async_save):
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from ckpt_tool.formats import open_checkpoint

    keys = ["model.a", "model.b", "model.c", "optimizer.exp_avg.a", "optimizer.exp_avg.b"]
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.full((8,), float(i)))
          for i, k in enumerate(keys)}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=4,
                                            separation_hint="optimizer.")
    if async_save:
        dc.save(sd, str(tmp_path), sharded_strategy=strategy,
                async_sharded_save=True).execute_sync()
    else:
        dc.save(sd, str(tmp_path), sharded_strategy=strategy)
    with open_checkpoint(tmp_path) as reader:
        files = {k: {c.file for c in t.chunks} for k, t in reader.metadata().tensors.items()}
    for k in keys:
        assert all(f.startswith("optimizer.__0_") == k.startswith("optimizer.")
                   for f in files[k]), (k, files[k])
    names = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len([n for n in names if n.startswith("optimizer.")]) == 2  # thread_count // 2
    plain = dc.load_plain_tensors(str(tmp_path))
    for i, k in enumerate(keys):
        assert torch.equal(plain[k], torch.full((8,), float(i)))


def test_separation_hint_needs_two_threads():
    from ckpt_tool.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    with pytest.raises(CheckpointingException, match="thread_count must be at least 2"):
        TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1, separation_hint="opt")


def _write_reformulated(tmp_path, orig, block):
    """A checkpoint like MCore <= 0.15 writes for flattened (distributed optimizer) tensors."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.dist_checkpointing.strategies._dcp_planner import (
        McoreFileSystemWriter, McoreSavePlanner, WriteTable)

    counts = [o // b for o, b in zip(orig.shape, block)]
    blocks = orig.reshape(counts[0], block[0], counts[1], block[1]).permute(0, 2, 1, 3)
    stored = blocks.reshape(counts[0], counts[1], block[0] * block[1]).contiguous()
    table = WriteTable()
    half = stored.shape[-1] // 2
    for i in range(counts[0]):
        for j in range(counts[1]):
            for s in (0, half):  # each block split in two flattened ranges
                table.add_chunk("opt.exp_avg", (i, j, s), stored[i:i + 1, j:j + 1, s:s + half].contiguous(),
                                stored.shape)
    writer = McoreFileSystemWriter(str(tmp_path), thread_count=1)
    md = dcp.save({}, storage_writer=writer, planner=McoreSavePlanner(table), no_dist=True)
    md.mcore_data = {"opt.exp_avg": {"nd_reformulated_orig_global_shape": tuple(orig.shape)}}
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    dc.core.save_config(dc.core.CheckpointingConfig("torch_dist"), str(tmp_path))
    torch.save({}, tmp_path / "common.pt")
    return stored


def test_nd_reformulated_tensors_come_back_in_original_shape(tmp_path):
    orig = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    _write_reformulated(tmp_path, orig, (3, 4))
    meta = dc.load_tensors_metadata(str(tmp_path))
    assert tuple(meta["opt.exp_avg"].global_shape) == (6, 8)
    assert torch.equal(dc.load_plain_tensors(str(tmp_path))["opt.exp_avg"], orig)
    # a region not aligned to the blocks
    req = {"r": ShardedTensor("opt.exp_avg", torch.zeros(3, 5), torch.float32, (3, 5), (6, 8),
                              (2, 1), None)}
    out = dc.load(req, str(tmp_path), validate_access_integrity=False)
    assert torch.equal(out["r"], orig[2:5, 1:6])
