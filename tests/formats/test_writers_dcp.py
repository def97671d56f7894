"""The streaming ``torch_dist`` and ``dcp`` writers (``ckpt_tool.formats.mcore_dist.torch_dist_writer``).

Every fixture (written by the real libraries) is written through a TensorSource over
``open_checkpoint(fixture)``, then read back: by our readers (bit-exact tensors, objects, the
common state), by ``torch.distributed.checkpoint`` itself (``dcp.load``,
``dcp_to_torch_save``), at a chunk grid other than the source's, and with a source that tracks
how many pulled chunks are alive at once (the memory bound).
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import math
import pickle
import re
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt_tool.errors import CorruptCheckpointError, UsageError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta

from _fixtures import fixture as _fixture

ALL = ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim", "dcp_plain",
       "mcore015_zarr_gpt_tp2pp2", "mcore015_gpt_flattened_optim", "megatron_legacy_tp2pp2",
       "megatron_legacy_tp2_release"]
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


class Source:
    """A TensorSource over a Reader that records every piece it hands out and how many of
    the pieces it handed out are still alive (their memory not yet freed) at each read."""

    def __init__(self, reader):
        self.reader = reader
        self.requests: list[tuple[str, tuple, tuple]] = []
        self.largest = 0
        self.max_alive_at_read = 0
        self._alive: list[weakref.ref] = []

    def read(self, key, offsets, sizes):
        self._alive = [r for r in self._alive if r() is not None]
        self.max_alive_at_read = max(self.max_alive_at_read, len(self._alive))
        self.requests.append((key, tuple(offsets), tuple(sizes)))
        slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        t = self.reader.read(key, slices or None).contiguous()
        # Hand out a tensor over a buffer we can watch: it dies with the last tensor using it.
        buf = _Buffer(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).reshape(t.shape) \
            if t.numel() else t.clone()
        if t.numel():
            self._alive.append(weakref.ref(buf))
        self.largest = max(self.largest, t.nbytes)
        return out


class _Buffer(bytearray):
    pass


def target_meta(meta: CheckpointMeta, split: int | None = None) -> CheckpointMeta:
    """The source's chunk grid (logical shape; whole tensor for N-D reformulated ones), or with
    ``split``: dim 0 cut into ``split`` near-equal pieces (a grid the source does not have)."""
    tensors = {}
    for k, t in meta.tensors.items():
        if split and t.shape and t.shape[0] >= split:
            bounds = [round(i * t.shape[0] / split) for i in range(split + 1)]
            chunks = tuple(ChunkRef((a, *(0,) * (len(t.shape) - 1)), (b - a, *t.shape[1:]))
                           for a, b in zip(bounds, bounds[1:]))
        elif t.stored_shape is not None or not t.chunks or split:
            chunks = (ChunkRef((0,) * len(t.shape), tuple(t.shape)),)
        else:
            seen: dict = {}
            for c in t.chunks:
                seen.setdefault(c.offsets, c.sizes)
            chunks = tuple(ChunkRef(o, s) for o, s in seen.items())
        tensors[k] = TensorMeta(k, t.dtype, t.shape, chunks)
    return CheckpointMeta(format="target", root="", tensors=tensors, objects=meta.objects,
                          common=meta.common)


def write(fmt: str, reader, out: Path, *, split=None, options=None, source=None):
    out.mkdir()
    src = source or Source(reader)
    progress: list[int] = []
    meta = target_meta(reader.metadata(), split)
    in_common = reader.objects_in_common()  # as plan_convert: they travel in the common state
    meta = dataclasses.replace(meta, objects=tuple(o for o in meta.objects
                                                   if o.unique_key not in in_common))
    req = WriteRequest(meta=meta, source=src,
                       common=reader.common(), objects=reader.read_object,
                       progress=progress.append)
    notes = writer_for(fmt)(out, options or WriterOptions()).write(req)
    return req, src, progress, notes


def bits(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8)


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        (da, sa, ba), (db, sb, bb) = bits(a), bits(b)
        return da == db and sa == sb and torch.equal(ba, bb)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a).__name__ == type(b).__name__ and same(vars(a), vars(b))
    if isinstance(b, np.generic) and not isinstance(a, np.generic):
        # a common state we write stores numpy scalars as Python scalars of the same value
        # (formats/mcore_dist/weights_only.py: what torch.load(weights_only=True) reads)
        return type(a) is type(b.item()) and a == b.item()
    return type(a) is type(b) and a == b


def assert_tensors_equal(src_reader, out_reader, keys=None):
    for k in keys or src_reader.metadata().tensors:
        expected, got = src_reader.read(k), out_reader.read(k)
        assert same(got, expected), k


# -- torch_dist ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_torch_dist_round_trip(name, tmp_path):
    src = open_checkpoint(_fixture(name))
    req, source, progress, notes = write("torch_dist", src, tmp_path / "out")
    out = open_checkpoint(tmp_path / "out")
    assert out.format_name == "torch_dist"
    assert json.loads((tmp_path / "out" / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}
    meta = out.metadata()
    assert meta.tensors.keys() == req.meta.tensors.keys()
    for k, t in req.meta.tensors.items():
        assert (meta.tensors[k].dtype, meta.tensors[k].shape) == (t.dtype, t.shape), k
        assert sorted(c.offsets for c in meta.tensors[k].chunks) == \
            sorted(c.offsets for c in t.chunks), k
    assert_tensors_equal(src, out)
    # ShardedObjects stay objects; what MCore could not parse as one goes into common.pt
    keys = [o.unique_key for o in req.meta.objects]
    sharded = [k for k in keys if re.fullmatch(r"[^/]+/shard_[\d.]+_[\d.]+", k)]
    others = [k for k in keys if k not in sharded]
    assert [o.unique_key for o in meta.objects] == sorted(sharded)
    for k in sharded:
        assert same(out.read_object(k), src.read_object(k)), k
    common = src.common()
    moved = [k for k in others if k not in common]
    assert same(out.common(), {**common, **{k: src.read_object(k) for k in moved}})
    notes = [n for n in notes if "numpy scalars stored as Python scalars" not in n]
    assert notes == ([f"stored {len(moved)} objects that are not Megatron-Core ShardedObjects "
                      f"(key not '<key>/shard_<offset>_<shape>') in common.pt: "
                      f"{', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}"]
                     if moved else [])
    assert bool(moved) == name.startswith("megatron_legacy")
    # every chunk pulled once, progress for each of them, data in a few __0_{i}.distcp files
    assert len(source.requests) == len(set(source.requests)) == \
        sum(len(t.chunks) for t in req.meta.tensors.values())
    assert sum(progress) == req.meta.total_bytes and len(progress) == len(source.requests)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp"]


def test_torch_dist_metadata_like_mcore(tmp_path):
    """``.metadata`` fields and the bytes items' encoding as Megatron-Core 0.16.1 writes them
    (compared with the fixture it wrote)."""
    fixture = _fixture("mcore016_gpt_tp2pp2_bf16_optim") / "iter_0000010"
    src = open_checkpoint(fixture)
    write("torch_dist", src, tmp_path / "out")
    theirs = pickle.loads((fixture / ".metadata").read_bytes())
    ours = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())
    assert type(ours) is type(theirs) and vars(ours).keys() == vars(theirs).keys()
    assert ours.planner_data is None and ours.version == theirs.version
    assert isinstance(ours.storage_meta.checkpoint_id, str) and ours.storage_meta.modules == []
    assert ours.state_dict_metadata.keys() == theirs.state_dict_metadata.keys()
    for k, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[k]
        if hasattr(md, "chunks"):
            assert (mine.properties, mine.size) == (md.properties, md.size), k
            assert sorted(map(tuple, (c.offsets for c in mine.chunks))) == \
                sorted(map(tuple, (c.offsets for c in md.chunks))), k
        else:
            assert type(mine) is type(md), k
    their_items = sorted(str(i) for p in theirs.all_local_plans for i in p.items)
    assert [str(i) for p in ours.all_local_plans for i in sorted(p.items, key=str)] == \
        their_items
    # a ShardedObject's bytes item is torch.save([payload]), byte for byte what MCore stored
    key = "rng_state/shard_0.0_2.2"

    def item(root, md):
        info = md.storage_data[next(i for i in md.storage_data if i.fqn == key)]
        with open(root / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return torch.load(__import__("io").BytesIO(f.read(info.length)), weights_only=False)

    assert same(item(tmp_path / "out", ours), item(fixture, theirs))
    common_theirs = torch.load(fixture / "common.pt", weights_only=False)
    common_ours = torch.load(tmp_path / "out" / "common.pt", weights_only=False)
    assert same(common_ours, common_theirs)


# -- plain DCP ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_dcp_round_trip(name, tmp_path):
    src = open_checkpoint(_fixture(name))
    req, source, progress, notes = write("dcp", src, tmp_path / "out")
    assert notes == []
    assert not (tmp_path / "out" / "metadata.json").exists()
    assert not (tmp_path / "out" / "common.pt").exists()
    out = open_checkpoint(tmp_path / "out")
    assert out.format_name == "dcp"
    assert_tensors_equal(src, out)
    for o in req.meta.objects:
        assert same(out.read_object(o.unique_key), src.read_object(o.unique_key)), o.unique_key

    # torch's own reader: the whole checkpoint, nested back through planner_data
    full = tmp_path / "full.pt"
    dcp_to_torch_save(tmp_path / "out", full)
    loaded = torch.load(full, weights_only=False)
    common = src.common()
    object_keys = {o.unique_key for o in req.meta.objects}
    expected_common = {k: v for k, v in flatten_state_dict(common)[0].items()
                       if k not in object_keys}
    if expected_common:  # as dcp.save stores a state dict (it also turns dict keys into str)
        nested = unflatten_state_dict(*flatten_state_dict(common))
        for top in common:
            assert same(loaded[top], nested[top]), top
    assert loaded.keys() == set(req.meta.tensors) | object_keys | set(common)
    for k in req.meta.tensors:
        assert same(loaded[k], src.read(k)), k
    for k in object_keys:
        assert same(loaded[k], src.read_object(k)), k

    # dcp.load into a state dict we give it: tensors and bytes items by key
    sd = {k: torch.zeros(t.shape, dtype=getattr(torch, t.dtype))
          for k, t in req.meta.tensors.items()}
    sd.update({k: None for k in object_keys})
    dcp.load(sd, checkpoint_id=tmp_path / "out", no_dist=True)
    for k in req.meta.tensors:
        assert same(sd[k], src.read(k)), k
    for k in object_keys:
        assert same(sd[k], src.read_object(k)), k
    assert sum(progress) >= req.meta.total_bytes


def test_dcp_common_state_as_dcp_items(tmp_path):
    """The common state is flattened as ``dcp.save`` flattens a state dict: nested paths in
    ``planner_data``, every value a bytes item (tensors too: a reader tells the model's tensors
    from the common state's)."""
    src = open_checkpoint(_fixture("mcore015_gpt_flattened_optim"))
    write("dcp", src, tmp_path / "out")
    md = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())
    assert md.planner_data["optimizer.optimizer.param_groups.0.lr"] == \
        ("optimizer", "optimizer", "param_groups", 0, "lr")
    assert md.planner_data["embedding.word_embeddings.weight"] == \
        ("embedding.word_embeddings.weight",)
    step = md.state_dict_metadata["optimizer.param_state.0.step"]
    assert not hasattr(step, "chunks")  # a bytes item, not a tensor item
    assert not hasattr(md.state_dict_metadata["args"], "chunks")
    sd = {"args": None, "iteration": None,
          "optimizer": {"param_state": {0: {"step": None}}}}
    dcp.load(sd, checkpoint_id=tmp_path / "out", no_dist=True)
    common = src.common()
    assert isinstance(sd["args"], argparse.Namespace) and same(sd["args"], common["args"])
    assert sd["iteration"] == common["iteration"] == 10
    from ckpt_tool.ops.diff._values import compare_common

    assert compare_common(common, open_checkpoint(tmp_path / "out").common()) == []


# -- another chunk grid, files, threads, memory ---------------------------------------------------
@pytest.mark.parametrize("fmt", ["torch_dist", "dcp"])
def test_other_chunk_grid(fmt, tmp_path):
    """Dim 0 cut in 3 (the source has 1, 2 or 4 chunks there): one DCP item per target chunk,
    exactly the asked grid, values equal."""
    src = open_checkpoint(_fixture("mcore016_gpt_tp2pp2_bf16_optim"))
    req, source, _, _ = write(fmt, src, tmp_path / "out", split=3,
                              options=WriterOptions(extra={"files": 3}))
    out = open_checkpoint(tmp_path / "out")
    md = pickle.loads((tmp_path / "out" / ".metadata").read_bytes())
    split = 0
    for k, t in req.meta.tensors.items():
        stored = md.state_dict_metadata[k].chunks
        assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in stored) == \
            sorted((c.offsets, c.sizes) for c in t.chunks), k
        split += len(t.chunks) == 3
    assert split > 40
    assert sorted(source.requests) == sorted((k, c.offsets, c.sizes)
                                             for k, t in req.meta.tensors.items()
                                             for c in t.chunks)
    assert_tensors_equal(src, out)
    assert len(list((tmp_path / "out").glob("__0_*.distcp"))) == 3


@pytest.mark.parametrize("threads", [1, 2])
def test_one_chunk_at_a_time(threads, tmp_path):
    """A pulled chunk is freed before the next one is pulled (per writing thread); the largest
    piece asked for is the largest target chunk, never a tensor or a file."""
    src = open_checkpoint(_fixture("mcore016_gpt_tp2pp2_fp32"))
    source = Source(src)
    req, _, _, _ = write("torch_dist", src, tmp_path / "out", split=3, source=source,
                         options=WriterOptions(extra={"files": 4, "threads": threads}))
    assert len(source.requests) > 40
    assert source.max_alive_at_read <= threads - 1
    largest_chunk = max(math.prod(c.sizes) * 4 for t in req.meta.tensors.values()
                        for c in t.chunks)
    assert source.largest == largest_chunk < max(t.nbytes for t in req.meta.tensors.values())
    assert_tensors_equal(src, open_checkpoint(tmp_path / "out"))


def test_stock_dcp_file_writer_would_hold_a_whole_file(tmp_path):
    """Why the writer has its own write loop: DCP's stock one keeps every tensor of a file
    alive until the file is closed (the check above catches it)."""
    from ckpt_tool.dist_checkpointing.strategies._dcp_planner import McoreFileSystemWriter
    from ckpt_tool.formats.containers.dcp import dcp_streaming as _write_dcp_io

    src = open_checkpoint(_fixture("mcore016_gpt_tp2pp2_fp32"))
    source = Source(src)
    meta = target_meta(src.metadata())
    items = [i for t in meta.tensors.values() for i in _write_dcp_io.chunk_write_items(t)]
    planner = _write_dcp_io.StreamingSavePlanner(items, source.read, lambda k: None)
    (tmp_path / "out").mkdir()
    dcp.save({}, storage_writer=McoreFileSystemWriter(str(tmp_path / "out"), thread_count=1),
             planner=planner, no_dist=True)
    assert source.max_alive_at_read > 10


# -- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [True, False])
def test_source_giving_the_wrong_piece_is_an_error(tmp_path, raw):
    src = open_checkpoint(_fixture("mcore016_gpt_tp2pp2_fp32"))

    class Wrong(Source):
        def read(self, key, offsets, sizes):
            return super().read(key, offsets, sizes).to(torch.float16)

    options = None if raw else WriterOptions(extra={"raw_save": False})
    expected = "gave float16 .* expected float32" if raw else "expected torch.float32"
    with pytest.raises(CorruptCheckpointError, match=expected):
        write("torch_dist", src, tmp_path / "out", source=Wrong(src), options=options)
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_grid_with_a_hole_is_refused(tmp_path):
    src = open_checkpoint(_fixture("mcore016_gpt_tp2pp2_fp32"))
    meta = target_meta(src.metadata())
    k = "embedding.word_embeddings.weight"
    t = meta.tensors[k]
    meta.tensors[k] = TensorMeta(k, t.dtype, t.shape, t.chunks[:1])
    (tmp_path / "out").mkdir()
    req = WriteRequest(meta=meta, source=Source(src), common={}, objects=src.read_object)
    with pytest.raises(UsageError, match="tile the tensor"):
        writer_for("dcp")(tmp_path / "out", WriterOptions()).write(req)


@pytest.mark.parametrize("fmt", ["torch_dist", "dcp"])
def test_empty_scalar_and_rare_dtypes(fmt, tmp_path):
    """A 0-element tensor, a 0-d one, bool, uint8 and float8 tensors given without a chunk
    grid (written whole), kept in their dtypes."""
    values = {"empty": torch.zeros(0, 4), "scalar": torch.tensor(7, dtype=torch.int64),
              "flags": torch.tensor([True, False, True]),
              "f8": torch.linspace(-2, 2, 12).reshape(4, 3).to(torch.float8_e4m3fn),
              "u8": torch.arange(6, dtype=torch.uint8).reshape(2, 3)}

    class Fixed:
        def read(self, key, offsets, sizes):
            return values[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]

    tensors = {k: TensorMeta(k, str(v.dtype).removeprefix("torch."), tuple(v.shape))
               for k, v in values.items()}
    (tmp_path / "out").mkdir()
    req = WriteRequest(meta=CheckpointMeta(format="x", root="", tensors=tensors),
                       source=Fixed(), common={"iteration": 3})
    assert writer_for(fmt)(tmp_path / "out", WriterOptions()).write(req) == []
    out = open_checkpoint(tmp_path / "out")
    assert out.format_name == fmt
    for k, v in values.items():
        assert same(out.read(k), v), k
    assert out.common() == {"iteration": 3}
