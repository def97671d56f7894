"""The torch-free torch_dist save (``dcp_torch_free_save``, ``dcp_torch_free_metadata``, ``pickle_refs``).

The same write request is written twice: through ``torch.distributed.checkpoint.save`` (the
DCP path) and through our own plan and ``.metadata`` pickle (the raw path, taken when the
common state and the objects can be copied as stored). The data files must be byte for byte
the same and ``.metadata`` must unpickle (with torch) into an equal ``Metadata``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import (PlannedItem, assign_files,
                                                                      check_grid)
from ckpt_tool.formats.containers.pickle.pickle_refs import Call, dumps, instance, ref
from ckpt_tool.model import ChunkRef, TensorMeta

from _fixtures import fixture as _fixture

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


# -- pickle_refs: references without importing them ------------------------------------------
def test_references_instances_and_calls_unpickle_into_the_real_objects():
    ns, od = ref("argparse", "Namespace"), ref("collections", "OrderedDict")
    cx, ln = ref("builtins", "complex"), ref("builtins", "len")
    data = dumps([instance(ns, {"a": 1}), instance(ns, {"b": [2]}), instance(ns),
                  Call(od, ([("x", 1)],)), Call(cx, (1.0, 2.0)), ln], [ns, od, cx, ln])
    assert pickle.loads(data) == [argparse.Namespace(a=1), argparse.Namespace(b=[2]),
                                  argparse.Namespace(), collections.OrderedDict(x=1),
                                  complex(1, 2), len]
    assert data.count(b"Namespace") == 1  # each reference is written once
    with pytest.raises(ValueError):
        dumps([], [ns], protocol=2)


# -- pure planning -------------------------------------------------------------------------------
def test_overlapping_chunks_are_refused_even_when_their_volumes_add_up():
    t = TensorMeta("w", "float32", (4, 4), (ChunkRef((0, 0), (2, 4)), ChunkRef((1, 0), (2, 4))))
    with pytest.raises(UsageError, match="overlap"):
        check_grid(t)
    check_grid(TensorMeta("w", "float32", (4, 4),
                          (ChunkRef((0, 0), (2, 4)), ChunkRef((2, 0), (2, 4)))))


def test_files_balance_bytes_and_put_bytes_items_first():
    items = [PlannedItem("a", (0,), (100,), "float32", (100,)),
             PlannedItem("b", (0,), (60,), "float32", (60,)),
             PlannedItem("c", (0,), (50,), "float32", (50,)), PlannedItem("obj/shard_0_1")]
    files = assign_files(items, 2)
    assert [(n, [i.fqn for i in b]) for n, b in files] == [
        ("__0_0.distcp", ["obj/shard_0_1", "a"]), ("__0_1.distcp", ["b", "c"])]
    named = assign_files(items, 2, file_of=lambda i: None if i.is_bytes else f"{i.fqn}.distcp")
    assert [n for n, _ in named] == ["a.distcp", "b.distcp", "c.distcp"]
    assert [i.fqn for i in named[0][1]] == ["obj/shard_0_1", "a"]


# -- the raw path against DCP's ------------------------------------------------------------------
def _write(reader, out: Path, *, raw: bool, threads: int = 1) -> None:
    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for

    meta = reader.metadata()
    tensors = {k: dataclasses.replace(t, chunks=tuple(ChunkRef(c.offsets, c.sizes)
                                                       for c in t.chunks))
               for k, t in meta.tensors.items() if t.stored_shape is None}
    meta = dataclasses.replace(meta, tensors=tensors)
    extra = {"common_file": reader.common_file(), "raw_object": reader.stored_object_bytes} \
        if raw else {}
    req = WriteRequest(meta=meta, source=reader, common={} if raw else reader.common(),
                       objects=reader.read_object, **extra)
    out.mkdir()

    class Source:  # the reader's tensors, whole chunks
        def read(self, key, offsets, sizes):
            return reader.read(key, tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                               or None).contiguous()

    req.source = Source()
    extra = {"threads": threads} if raw else {"threads": threads, "raw_save": False}
    writer_for("torch_dist")(out, WriterOptions(extra=extra)).write(req)


@pytest.mark.parametrize("name,threads", [("mcore016_gpt_tp2pp2_bf16_optim", 1),
                                          ("mcore016_gpt_tp2pp2_fp32", 2)])
def test_raw_path_writes_what_dcp_writes(name, threads, tmp_path, monkeypatch):
    import torch

    from ckpt_tool.formats import open_checkpoint
    from ckpt_tool.formats.containers.dcp import dcp_torch_free_save as dcp_raw_save

    reader = open_checkpoint(_fixture(name))
    if reader.common_file() is None:
        pytest.skip("the fixture's common.pt needs torch to load")
    calls = []
    real = dcp_raw_save.torch_free_dcp_save
    monkeypatch.setattr(dcp_raw_save, "torch_free_dcp_save",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    _write(reader, tmp_path / "dcp", raw=False, threads=threads)
    assert not calls
    _write(reader, tmp_path / "raw", raw=True, threads=threads)
    assert calls == [1]
    data = sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp"))
    assert data and data == sorted(p.name for p in (tmp_path / "raw").glob("*.distcp"))
    for f in data:
        assert (tmp_path / "dcp" / f).read_bytes() == (tmp_path / "raw" / f).read_bytes(), f
    theirs = pickle.loads((tmp_path / "dcp" / ".metadata").read_bytes())
    ours = pickle.loads((tmp_path / "raw" / ".metadata").read_bytes())
    assert type(ours) is type(theirs) and vars(ours).keys() == vars(theirs).keys()
    assert ours.storage_meta.checkpoint_id == str(tmp_path / "raw")
    ours.storage_meta = theirs.storage_meta  # the path and a fresh UUID
    assert ours == theirs
    assert list(ours.storage_data) == list(theirs.storage_data)
    assert torch.load(tmp_path / "raw" / "common.pt", weights_only=False).keys() == \
        torch.load(tmp_path / "dcp" / "common.pt", weights_only=False).keys()
    for out in ("dcp", "raw"):
        assert json.loads((tmp_path / out / "metadata.json").read_text())[
            "sharded_backend"] == "torch_dist"
    # torch's own reader takes it: every tensor equal to the source's
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "raw", tmp_path / "raw.pt")
    loaded = torch.load(tmp_path / "raw.pt", weights_only=False)
    for k in ours.state_dict_metadata:
        if k in reader.metadata().tensors and isinstance(loaded.get(k), torch.Tensor):
            assert torch.equal(loaded[k].view(torch.uint8), reader.read(k).view(torch.uint8)), k


def test_convert_torch_dist_to_torch_dist_never_imports_torch(tmp_path):
    src = _fixture("mcore016_gpt_tp2pp2_bf16_optim") / "iter_0000010"
    code = ("import sys, json; from ckpt_tool.ops.convert import convert; from ckpt_tool.ops.convert import ConvertOptions;"
            f"r = convert({str(src)!r}, {str(tmp_path / 'out')!r}, ConvertOptions(to='torch_dist'));"
            "print(json.dumps(['torch' in sys.modules, r.verified]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True]
    assert (tmp_path / "out" / src.name / ".metadata").is_file()  # an iteration directory


def _same_output(raw: Path, dcp: Path) -> None:
    """Data files byte for byte, ``.metadata`` an equal ``Metadata``, ``common.pt`` equal
    values (torch.save's bytes depend on which strings the process had interned)."""
    import torch

    data = sorted(p.name for p in raw.glob("*.distcp"))
    assert data and data == sorted(p.name for p in dcp.glob("*.distcp"))
    for f in data:
        assert (raw / f).read_bytes() == (dcp / f).read_bytes(), f
    ours = pickle.loads((raw / ".metadata").read_bytes())
    theirs = pickle.loads((dcp / ".metadata").read_bytes())
    ours.storage_meta = theirs.storage_meta  # the staging path and a fresh UUID
    assert ours == theirs
    assert list(ours.storage_data) == list(theirs.storage_data)
    a, b = (torch.load(d / "common.pt", weights_only=False) for d in (raw, dcp))
    assert a.keys() == b.keys() and vars(a["args"]) == vars(b["args"])
    assert {k: v for k, v in a.items() if k != "args"} == \
        {k: v for k, v in b.items() if k != "args"}
    assert (raw / "integrity.json").is_file() and (raw / "metadata.json").is_file()


def test_reshard_takes_the_raw_path_and_writes_what_dcp_writes(tmp_path, monkeypatch, raw_saves):
    """``reshard`` of a torch_dist source (one process, 2 I/O threads): the raw path (not
    DCP's save: ``raw_saves`` counts it, ``dcp.save`` would raise), output equal to the DCP
    path's; its args are the target's (tp 1, pp 1)."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.formats.mcore_dist import torch_dist_writer
    from ckpt_tool.ops.reshard import ReshardRequest, reshard

    src = _fixture("mcore016_gpt_tp2pp2_bf16_optim")
    with monkeypatch.context() as m:
        m.setattr(torch_dist_writer.TorchDistWriter, "_write_raw", lambda *a: False)
        reshard(src, tmp_path / "dcp", ReshardRequest(tp=1, pp=1), workers=2)
    assert raw_saves == []

    def refuse(*a, **k):
        raise AssertionError("DCP's save was called")

    monkeypatch.setattr(dcp, "save", refuse)
    assert reshard(src, tmp_path / "raw", ReshardRequest(tp=1, pp=1), workers=2).written
    assert len(raw_saves) == 1
    _same_output(tmp_path / "raw" / "iter_0000010", tmp_path / "dcp" / "iter_0000010")
    import torch

    args = torch.load(tmp_path / "raw" / "iter_0000010" / "common.pt",
                      weights_only=False)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)


@pytest.mark.multiproc
def test_two_ranks_convert_and_reshard_write_what_dcp_writes(tmp_path):
    """Under torchrun (2 gloo ranks) ``convert --to torch_dist``, ``reshard`` and ``convert
    --to dcp`` take the raw path on every rank; data files, ``.metadata`` (two local plans
    for torch_dist) and the common state equal the DCP path's."""
    src = _fixture("mcore016_gpt_tp2pp2_bf16_optim")
    worker = Path(__file__).resolve().parent / "_raw_save_ranks_worker.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(worker), str(src), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("VERDICT "))
    verdict = json.loads(line.removeprefix("VERDICT "))
    for name in ("convert", "reshard", "convert_dcp"):
        got = verdict[name]
        assert any(f.startswith("__1_") for f in got.pop("files")), name  # rank 1 wrote
        plain = name == "convert_dcp"  # plain DCP: no common.pt, no all_local_plans
        assert got == {"same_names": True, "same_bytes": True, "same_common": True,
                       "metadata_equal": True, "storage_order": True,
                       "plans": None if plain else 2, "staged_ids": True, "manifest": True,
                       "raw_on_every_rank": True}, name
