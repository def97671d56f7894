"""The torch, safetensors and zarr writers: round trips from every fixture format through our
readers, the real libraries reading the output, shard splitting, slab streaming with bounded
piece sizes, dropped-things notes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tool.errors import UnsupportedError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE_NAMES = ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim", "dcp_plain",
                 "mcore015_zarr_gpt_tp2pp2", "mcore015_gpt_flattened_optim",
                 "megatron_legacy_tp2pp2", "megatron_legacy_tp2_release"]
WRITERS = ["safetensors", "torch", "zarr"]


class ReaderSource:
    """A TensorSource over a Reader that records the largest piece asked for."""

    def __init__(self, reader):
        self.reader = reader
        self.largest = 0
        self.pieces = 0

    def read(self, key, offsets, sizes):
        t = self.reader.read(key, tuple(slice(o, o + s) for o, s in zip(offsets, sizes)))
        self.largest = max(self.largest, t.numel() * t.element_size())
        self.pieces += 1
        return t


class MemSource(ReaderSource):
    """A TensorSource over a dict of tensors (hands out views, as a lazy source may)."""

    def __init__(self, tensors):
        super().__init__(None)
        self.tensors = tensors

    def read(self, key, offsets, sizes):
        t = self.tensors[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        self.largest = max(self.largest, t.numel() * t.element_size())
        self.pieces += 1
        return t.contiguous()


def _meta(tensors, chunks=None, objects=()):
    return CheckpointMeta(format="mem", root="", objects=tuple(objects), tensors={
        k: TensorMeta(k, str(v.dtype).removeprefix("torch."), tuple(v.shape),
                      chunks=tuple((chunks or {}).get(k, ())))
        for k, v in tensors.items()})


def _bits(t):
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def _same(a, b):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
    assert torch.equal(_bits(a), _bits(b))


def _write(fmt, out, request, **opts):
    out.mkdir(parents=True, exist_ok=True)
    return writer_for(fmt)(out, WriterOptions(**opts)).write(request)


def _output(fmt, out):
    return out / "model.pt" if fmt == "torch" else out


@pytest.fixture(scope="module")
def fixture_readers():
    readers = {}
    for name in FIXTURE_NAMES:
        r = open_checkpoint(FIXTURES / name)
        readers[name] = (r, {k: r.read(k) for k in r.metadata().tensors})
    yield readers
    for r, _ in readers.values():
        r.close()


SMALL = {
    "w.fp32": torch.randn(7, 5, generator=torch.Generator().manual_seed(1)),
    "w.bf16": torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(2)).bfloat16(),
    "ids": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "f8": torch.randn(9, generator=torch.Generator().manual_seed(3)).to(torch.float8_e4m3fn),
    "empty": torch.zeros(0, 4),
}


@pytest.mark.parametrize("fmt", WRITERS)
@pytest.mark.parametrize("fixture", FIXTURE_NAMES)
def test_round_trip_from_every_fixture_is_bit_exact(tmp_path, fixture_readers, fixture, fmt):
    reader, expected = fixture_readers[fixture]
    meta = reader.metadata()
    progress = []
    request = WriteRequest(meta=meta, source=ReaderSource(reader), common=reader.common(),
                           objects=reader.read_object, progress=progress.append,
                           source_description=f"{meta.format}:{fixture}")
    _write(fmt, tmp_path / "out", request)
    assert sum(progress) == meta.total_bytes
    back = open_checkpoint(_output(fmt, tmp_path / "out"))
    assert back.format_name == fmt
    assert set(back.metadata().tensors) == set(expected)
    assert any(t.dtype == "bfloat16" for t in back.metadata().tensors.values()) == \
        any(t.dtype == torch.bfloat16 for t in expected.values())
    for key, want in expected.items():
        _same(back.read(key), want)


@pytest.mark.parametrize("fmt", WRITERS)
def test_tiny_budget_over_a_real_reader_bounds_every_piece(tmp_path, fixture_readers, fmt):
    reader, expected = fixture_readers["mcore015_gpt_flattened_optim"]  # bf16 + N-D flattened
    source = ReaderSource(reader)
    _write(fmt, tmp_path, WriteRequest(meta=reader.metadata(), source=source), max_memory=4096)
    assert source.largest <= 4096 < max(t.nbytes for t in expected.values())
    back = open_checkpoint(_output(fmt, tmp_path))
    for key, want in expected.items():
        _same(back.read(key), want)


def test_safetensors_is_what_the_real_library_reads(tmp_path, fixture_readers):
    from safetensors import safe_open
    from safetensors.torch import load_file

    reader, expected = fixture_readers["mcore016_gpt_tp2pp2_bf16_optim"]
    notes = _write("safetensors", tmp_path, WriteRequest(
        meta=reader.metadata(), source=ReaderSource(reader), common=reader.common(),
        source_description="torch_dist:/ckpt/iter_0000010"))
    # the model's weights alone in model.safetensors, the optimizer state beside them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors",
                                                          "optimizer.safetensors"]
    loaded = load_file(str(tmp_path / "model.safetensors"))
    optim = load_file(str(tmp_path / "optimizer.safetensors"))
    assert loaded and optim and not set(loaded) & set(optim)
    assert all(k.startswith("optimizer.") for k in optim)
    assert not any(k.startswith("optimizer.") for k in loaded)
    loaded.update(optim)
    assert set(loaded) == set(expected)
    for k, v in loaded.items():
        _same(v, expected[k])
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        md = f.metadata()
    assert md["format"] == "pt" and md["source"] == "torch_dist:/ckpt/iter_0000010"
    assert md["iteration"] == "10" and md["checkpoint_version"] == "3.0"
    assert "args" not in md
    assert any(n.startswith("dropped 4 common values (args, content_metadata, "
                            "opt_param_scheduler, optimizer)") for n in notes)
    assert any(n.startswith("dropped 20 ShardedObjects") for n in notes)
    raw = (tmp_path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    header = json.loads(raw[8:8 + n])
    assert next(iter(header)) == "__metadata__"


def test_safetensors_shards_like_huggingface(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(10, 10), "big": torch.randn(30, 10), "b": torch.randn(5, 10),
               "c": torch.randn(5, 10), "d": torch.randn(20, 10).bfloat16()}
    # 400 + 1200 + 200 + 200 + 400 bytes, limit 800. huggingface_hub's splitter emits a tensor
    # over the limit at once (shard 1), then fills shards in order: [a b c] = 800, then [d].
    _write("safetensors", tmp_path, WriteRequest(meta=_meta(tensors), source=MemSource(tensors)),
           max_shard_size=800)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert index["weight_map"] == {"big": names[0], "a": names[1], "b": names[1],
                                   "c": names[1], "d": names[2]}
    for name in names[:3]:
        part = load_file(str(tmp_path / name))
        assert sum(t.nbytes for t in part.values()) <= 800 or set(part) == {"big"}
        for k, v in part.items():
            _same(v, tensors[k])
    back = open_checkpoint(tmp_path)
    for k, v in tensors.items():
        _same(back.read(k), v)


def test_safetensors_file_name_and_dtypes(tmp_path):
    from safetensors.torch import load_file

    _write("safetensors", tmp_path, WriteRequest(meta=_meta(SMALL), source=MemSource(SMALL)),
           file_name="weights.safetensors")
    loaded = load_file(str(tmp_path / "weights.safetensors"))
    for k, v in SMALL.items():
        _same(loaded[k], v)
    c = {"z": torch.zeros(2, dtype=torch.complex128)}
    with pytest.raises(UnsupportedError, match="'z'"):
        _write("safetensors", tmp_path / "c", WriteRequest(meta=_meta(c), source=MemSource(c)))


def test_torch_file_is_byte_identical_to_torch_save(tmp_path):
    _write("torch", tmp_path / "ours", WriteRequest(meta=_meta(SMALL), source=MemSource(SMALL)))
    torch.save(SMALL, tmp_path / "model.pt")
    ours, theirs = tmp_path / "ours" / "model.pt", tmp_path / "model.pt"
    with zipfile.ZipFile(ours) as a, zipfile.ZipFile(theirs) as b:
        assert a.namelist() == b.namelist()
        assert a.testzip() is None  # every CRC32 right
        for name in b.namelist():
            assert a.read(name) == b.read(name), name
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = torch.load(ours, weights_only=True, mmap=True)
    assert list(loaded) == list(SMALL)
    for k, v in SMALL.items():
        _same(loaded[k], v)


def test_torch_file_with_a_non_ascii_name_is_torch_saves_archive(tmp_path):
    """torch.save gives such a file the record prefix ``archive``; ours is the same file, also
    with a tensor over the budget (filled in place afterwards)."""
    _write("torch", tmp_path / "ours", WriteRequest(meta=_meta(SMALL), source=MemSource(SMALL)),
           file_name="modèle.pt")
    torch.save(SMALL, tmp_path / "modèle.pt")
    assert (tmp_path / "ours" / "modèle.pt").read_bytes() == (tmp_path / "modèle.pt").read_bytes()
    _write("torch", tmp_path / "slab", WriteRequest(meta=_meta(SMALL), source=MemSource(SMALL)),
           file_name="modèle.pt", max_memory=16)
    _same_records(tmp_path / "slab" / "modèle.pt", tmp_path / "modèle.pt")


_FULL_DISK = """
import contextlib, sys
import ckpt_tool.formats.torch_save.writer as w
w.zip_writer_name = contextlib.contextmanager(lambda path: (yield "/dev/full"))
from ckpt_tool.cli.app import main
sys.argv = ["ckpt", "convert", sys.argv[1], sys.argv[2], "--to", "torch"]
main()
"""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_torch_write_failure_is_one_line_not_an_abort(tmp_path):
    """A failed write leaves torch's zip writer unfinished; finishing it in its C++ destructor
    would fail again and abort the process (SIGABRT) -- as Ctrl-C during a write did."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _FULL_DISK,
                           str(FIXTURES / "mcore016_gpt_tp2pp2_fp32"), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "writing the archive failed" in proc.stderr
    assert "disk full" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and os.listdir(tmp_path) == []


def _same_records(ours, theirs):
    """Same zip records with the same bytes and right CRCs, except the write-time id."""
    with zipfile.ZipFile(ours) as a, zipfile.ZipFile(theirs) as b:
        assert a.namelist() == b.namelist()
        assert a.testzip() is None
        for name in b.namelist():
            assert name.endswith("serialization_id") or a.read(name) == b.read(name), name
            ia, ib = a.getinfo(name), b.getinfo(name)
            assert (ia.header_offset, ia.file_size) == (ib.header_offset, ib.file_size), name


def test_torch_big_tensors_stream_in_slabs(tmp_path):
    big = {"w": torch.randn(64, 33), "v": torch.randn(3, 4, 50).bfloat16(), "s": torch.ones(3)}
    src = MemSource(big)
    _write("torch", tmp_path / "slab", WriteRequest(meta=_meta(big), source=src),
           max_memory=1000, file_name="ckpt.pt")
    assert src.largest <= 1000 and src.pieces > len(big)
    assert [p.name for p in (tmp_path / "slab").iterdir()] == ["ckpt.pt"]
    torch.save(big, tmp_path / "ckpt.pt")
    _same_records(tmp_path / "slab" / "ckpt.pt", tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "slab" / "ckpt.pt", weights_only=True, mmap=True)
    for k, v in big.items():
        _same(loaded[k], v)


def test_torch_common_values(tmp_path, fixture_readers):
    reader, expected = fixture_readers["megatron_legacy_tp2pp2"]
    common = reader.common()
    request = WriteRequest(meta=reader.metadata(), source=ReaderSource(reader), common=common,
                           objects=reader.read_object)
    notes = _write("torch", tmp_path / "plain", request)
    assert set(torch.load(tmp_path / "plain" / "model.pt", weights_only=True)) == set(expected)
    assert any("args" in n and "iteration" in n for n in notes)
    assert any(n.startswith("dropped 8 ShardedObjects") for n in notes)
    notes = _write("torch", tmp_path / "keep", request, extra={"torch_keep_common": True})
    loaded = torch.load(tmp_path / "keep" / "model.pt", weights_only=True)
    assert loaded["iteration"] == 10 and loaded["checkpoint_version"] == 3.0
    assert "args" not in loaded and "rng_state" not in loaded
    assert any(n.startswith("dropped") and "args" in n and "iteration" not in n for n in notes)


def test_slab_streaming_bounds_every_piece(tmp_path):
    tensors = {"w": torch.randn(40, 30), "wide": torch.randn(2, 500), "b": torch.randn(3, 7, 9)
               .bfloat16()}
    for fmt in WRITERS:
        src = MemSource(tensors)
        ref = MemSource(tensors)
        _write(fmt, tmp_path / fmt, WriteRequest(meta=_meta(tensors), source=src),
               max_memory=256)
        _write(fmt, tmp_path / f"{fmt}-ref", WriteRequest(meta=_meta(tensors), source=ref))
        assert src.largest <= 256, fmt  # a row of "wide" (2000 bytes) is split too
        assert ref.largest == max(t.nbytes for t in tensors.values())
        back = open_checkpoint(_output(fmt, tmp_path / fmt))
        for k, v in tensors.items():
            _same(back.read(k), v)
        if fmt == "torch":
            _same_records(tmp_path / fmt / "model.pt", tmp_path / "torch-ref" / "model.pt")
        elif fmt == "safetensors":  # (zarr regrids without a target grid: other chunk files)
            for f in (tmp_path / fmt).iterdir():
                assert f.read_bytes() == (tmp_path / f"{fmt}-ref" / f.name).read_bytes()


def test_safetensors_threads_write_the_same_bytes(tmp_path):
    # slabs of several shards written by 4 threads at their offsets (pwrite)
    gen = torch.Generator().manual_seed(5)
    tensors = {f"layer{i}.w": torch.randn(17 + i, 13, generator=gen) for i in range(9)}
    tensors["big"] = torch.randn(64, 64, generator=gen).bfloat16()
    tensors["optimizer.m"] = torch.randn(33, generator=gen)
    outs = {}
    for threads in (1, 4):
        out = tmp_path / f"t{threads}"
        src = MemSource(tensors)
        done = []
        _write("safetensors", out, WriteRequest(meta=_meta(tensors), source=src,
                                                progress=done.append),
               max_memory=512, max_shard_size=3000, extra={"threads": threads})
        assert src.largest <= 512 and sum(done) == sum(t.nbytes for t in tensors.values())
        outs[threads] = {f.name: f.read_bytes() for f in out.iterdir()}
    assert len(outs[1]) > 3 and outs[1] == outs[4]
    back = open_checkpoint(tmp_path / "t4")
    for k, v in tensors.items():
        _same(back.read(k), v)


def _zarr_chunks(shape, chunk):
    grid = [range(0, s, c) for s, c in zip(shape, chunk)]
    import itertools

    return [ChunkRef(offsets=o, sizes=tuple(min(c, s - x) for c, s, x in zip(chunk, shape, o)))
            for o in itertools.product(*grid)]


def test_zarr_output_matches_mcore_fixture_bytes(tmp_path, fixture_readers):
    reader, _ = fixture_readers["mcore015_zarr_gpt_tp2pp2"]
    notes = _write("zarr", tmp_path, WriteRequest(
        meta=reader.metadata(), source=ReaderSource(reader), common=reader.common(),
        objects=reader.read_object))
    assert notes == []
    src = reader.root
    for key in reader.metadata().tensors:
        for f in (src / key).iterdir():
            assert (tmp_path / key / f.name).read_bytes() == f.read_bytes(), f"{key}/{f.name}"
        assert sorted(p.name for p in (tmp_path / key).iterdir()) == \
            sorted(p.name for p in (src / key).iterdir())
    assert json.loads((tmp_path / "metadata.json").read_text()) == \
        json.loads((src / "metadata.json").read_text())
    assert (tmp_path / "rng_state" / "shard_0.1_2.2.pt").is_file()


def test_zarr_is_read_by_tensorstore_and_loaded_at_another_sharding(tmp_path, fixture_readers):
    from ckpt_tool.dist_checkpointing import serialization
    from ckpt_tool.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from ckpt_tool.formats.mcore_dist.zarr_store import numpy_to_tensor, open_ts_array

    reader, expected = fixture_readers["mcore016_gpt_tp2pp2_bf16_optim"]
    _write("zarr", tmp_path, WriteRequest(
        meta=reader.metadata(), source=ReaderSource(reader), common=reader.common(),
        objects=reader.read_object))
    assert json.loads((tmp_path / "embedding.word_embeddings.weight" / ".zarray").read_text()
                      )["dtype"] == "bfloat16"
    for key in ("embedding.word_embeddings.weight", "optimizer.state.exp_avg.output_layer.weight",
                "decoder.layers.mlp.linear_fc1.weight"):
        _same(numpy_to_tensor(open_ts_array(tmp_path / key).read().result()), expected[key])
    emb = expected["embedding.word_embeddings.weight"]  # saved at TP=2: load a quarter of it
    fc1 = expected["decoder.layers.mlp.linear_fc1.weight"]
    rng = ShardedObject("rng_state", None, (2, 2), (1, 0), replica_id=0)
    request = {
        "emb": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight",
                                               torch.empty(32, 64, dtype=torch.bfloat16),
                                               (0, 2, 4)),
        "fc1": ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight",
                                               torch.empty(1, 256, 32, dtype=torch.bfloat16),
                                               (0, 3, 4), (2, 1, 2)),
        "rng": rng,
    }
    out = serialization.load(request, str(tmp_path), validate_access_integrity=False)
    _same(out["emb"], emb[64:96])
    _same(out["fc1"], fc1[3:4, :, 32:])
    assert out["iteration"] == 10 and out["args"].tensor_model_parallel_size == 2
    want_rng = reader.read_object("rng_state/shard_1.0_2.2")
    assert isinstance(want_rng, list) and set(out["rng"][0]) == set(want_rng[0])
    _same(out["rng"][0]["torch_rng_state"], want_rng[0]["torch_rng_state"])


def test_zarr_grids_padding_and_dtypes(tmp_path):
    from ckpt_tool.formats.mcore_dist.zarr_store import numpy_to_tensor, open_ts_array

    t = {"irregular": torch.randn(5, 6), "regular": torch.randn(6, 4).bfloat16(),
         "scalar": torch.tensor(7, dtype=torch.int32), "empty": torch.zeros(0, 3)}
    chunks = {"irregular": [ChunkRef((0, 0), (2, 6)), ChunkRef((2, 0), (3, 6))],  # 2 + 3 rows
              "regular": _zarr_chunks((6, 4), (4, 3)),  # edge chunks on both axes
              "scalar": [ChunkRef((), ())], "empty": [ChunkRef((0, 0), (0, 3))]}
    src = MemSource(t)
    notes = _write("zarr", tmp_path, WriteRequest(meta=_meta(t, chunks), source=src),
                   max_memory=40)
    assert src.largest <= 40
    za = {k: json.loads((tmp_path / k / ".zarray").read_text()) for k in t}
    assert za["regular"]["chunks"] == [4, 3] and za["regular"]["dtype"] == "bfloat16"
    assert za["irregular"]["chunks"] == [1, 6]  # 24 bytes a row: one row per chunk
    assert any("1 tensor had no regular chunk grid (irregular)" in n for n in notes)
    # edge chunk "1.1" holds rows 4-5 x col 3 (+ zero padding): full 4x3 bf16 chunk file
    assert (tmp_path / "regular" / "1.1").stat().st_size == 4 * 3 * 2
    for k, v in t.items():
        arr = open_ts_array(tmp_path / k).read().result()
        assert arr.shape == tuple(v.shape)
        # reshape: _zarr_io.numpy_to_tensor turns a 0-d array 1-d (np.ascontiguousarray)
        _same(numpy_to_tensor(arr).reshape(v.shape), v)
    back = open_checkpoint(tmp_path)
    for k, v in t.items():
        _same(back.read(k), v)
    f8 = {"f8": torch.zeros(2).to(torch.float8_e5m2)}
    with pytest.raises(UnsupportedError, match="'f8'"):
        _write("zarr", tmp_path / "f8", WriteRequest(meta=_meta(f8), source=MemSource(f8)))


def test_zarr_objects_and_common(tmp_path):
    t = {"w": torch.arange(6.0).reshape(2, 3)}
    objs = [ObjectMeta("rng_state", "rng_state/shard_0.1_2.2", global_shape=(2, 2),
                       global_offset=(0, 1)),
            ObjectMeta("extra.note", "extra.note")]
    payloads = {"rng_state/shard_0.1_2.2": {"seed": 5}, "extra.note": "x"}
    notes = _write("zarr", tmp_path, WriteRequest(
        meta=_meta(t, objects=objs), source=MemSource(t), common={"iteration": 3},
        objects=payloads.get))
    assert notes == ["dropped 1 object (extra.note): not ShardedObject keys "
                     "(<key>/shard_<offsets>_<shape>), which the zarr layout cannot address"]
    assert torch.load(tmp_path / "rng_state" / "shard_0.1_2.2.pt") == {"seed": 5}
    assert torch.load(tmp_path / "common.pt") == {"iteration": 3}
    meta = open_checkpoint(tmp_path).metadata()
    assert [o.unique_key for o in meta.objects] == ["rng_state/shard_0.1_2.2"]
    assert meta.common.get("iteration") == 3
    assert not any(p.name.endswith(".pt") for p in tmp_path.iterdir() if p.name != "common.pt")
    assert math.prod(meta.tensors["w"].shape) == 6


def test_zarr_refuses_unsafe_keys_and_writes_stand_ins_back(tmp_path):
    from ckpt_tool.formats.containers.pickle.safe_pickle import stand_in_class

    for key in ("../escape", "/abs", "a//b"):
        t = {key: torch.zeros(2)}
        with pytest.raises(UnsupportedError, match="safe relative path"):
            _write("zarr", tmp_path / "k", WriteRequest(meta=_meta(t), source=MemSource(t)))
    assert not (tmp_path / "escape").exists()
    # a megatron enum read without megatron is written back as that enum
    backend = stand_in_class("megatron.core.transformer.enums", "AttnBackend")(5)
    t = {"w": torch.zeros(2)}
    _write("zarr", tmp_path / "s", WriteRequest(meta=_meta(t), source=MemSource(t),
                                                common={"args": {"attention_backend": backend}}))
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    again = load_torch_file(tmp_path / "s" / "common.pt")["args"]["attention_backend"]
    if "__stand_in_for__" in dir(again):  # read back without megatron: the stand-in again
        assert again.__stand_in_for__ == "megatron.core.transformer.enums.AttnBackend"
        assert again.fields()["_args"] == (5,)
    else:  # megatron imported in this process (an earlier test): the real enum
        assert f"{type(again).__module__}.{type(again).__qualname__}" == \
            "megatron.core.transformer.enums.AttnBackend"
        assert again.value == 5


# Run by a Python with the REAL megatron-core 0.15.3 (the last with the zarr backend); it must
# not import ckpt_tool. One process, a 1-rank gloo group (0.15.3's loads need one).
MCORE015_WORKER = '''\
import os, sys, socket
import numpy as np
import torch
torch.cuda.synchronize = lambda *a, **k: None
import torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

def main(ckpt, out):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # common.pt written under numpy 2 names numpy._core; this Python may have numpy 1
    torch.serialization.add_safe_globals([
        np.core.multiarray.scalar, (np.core.multiarray.scalar, "numpy._core.multiarray.scalar"),
        np.core.multiarray._reconstruct,
        (np.core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray, np.dtype, type(np.dtype("float64")), type(np.dtype("uint32"))])
    result = {}
    plain = dc.load_plain_tensors(ckpt)
    for k, v in plain.items():
        if isinstance(v, torch.Tensor):
            result["plain/" + k] = v
    meta = dc.load_tensors_metadata(ckpt)
    request = {}
    for key, st in meta.items():
        shape = tuple(st.global_shape)
        axis = next((i for i, n in enumerate(shape) if n % 2 == 0), None)
        if axis is None:
            continue
        for part in range(2):
            piece = torch.empty(shape, dtype=st.dtype).chunk(2, axis)[part].contiguous()
            request[f"{key}#{part}#{axis}"] = ShardedTensor.from_rank_offsets(
                key, piece, (axis, part, 2))
    objs = {k: v for k, v in dc.serialization.load_sharded_metadata(ckpt).items()
            if isinstance(v, ShardedObject)}
    request.update({"obj/" + k: v for k, v in objs.items()})
    loaded = dc.load(request, ckpt, validate_access_integrity=False)
    for k, v in loaded.items():
        if "#" in k:
            result["part/" + k] = v
    result["iteration"] = torch.tensor(loaded["iteration"])
    torch.save(result, out)
    print(f"OK {len(plain)} plain, {len(request) - len(objs)} parts, {len(objs)} objects")

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)
'''
MCORE015_PYTHON = os.environ.get("CKPT_MCORE015_PYTHON") or next(
    (str(p) for p in (Path(__file__).resolve().parents[2] / ".venv015" / "bin" / "python",
                      Path("/tmp/venv015/bin/python")) if p.exists()), "/tmp/venv015/bin/python")


@pytest.mark.interop
@pytest.mark.skipif(not os.path.exists(MCORE015_PYTHON),
                    reason=f"no megatron-core 0.15 Python at {MCORE015_PYTHON}")
def test_mcore015_loads_our_zarr(tmp_path, fixture_readers):
    reader, expected = fixture_readers["mcore016_gpt_tp2pp2_bf16_optim"]
    ckpt = tmp_path / "ckpt"
    _write("zarr", ckpt, WriteRequest(meta=reader.metadata(), source=ReaderSource(reader),
                                      common=reader.common(), objects=reader.read_object))
    (tmp_path / "worker.py").write_text(MCORE015_WORKER)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([MCORE015_PYTHON, "-W", "ignore", str(tmp_path / "worker.py"),
                           str(ckpt), str(tmp_path / "out.pt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert "OK 71 plain, 128 parts, 20 objects" in proc.stdout, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert int(got.pop("iteration")) == 10
    plain = {k[len("plain/"):]: v for k, v in got.items() if k.startswith("plain/")}
    assert set(plain) == set(expected)
    for k, v in plain.items():
        _same(v, expected[k])
    parts = [k for k in got if k.startswith("part/")]
    assert len(parts) == 128
    for name in parts:
        key, part, axis = name[len("part/"):].split("#")
        _same(got[name], expected[key].chunk(2, int(axis))[int(part)])


def _launch():
    spec = importlib.util.spec_from_file_location(
        "launch", Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"
        / "launch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.multiproc
def test_ranks_share_the_writing_and_fail_together(tmp_path, fixture_readers):
    _, expected = fixture_readers["mcore016_gpt_tp2pp2_bf16_optim"]
    out = _launch().torchrun(str(Path(__file__).resolve()), 2, str(tmp_path))
    assert "rank 1: ValueError: injected" in out and \
        "rank 0: UsageError: another rank failed" in out, out[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for fmt in ("zarr", "safetensors"):
        per_rank = report[fmt]
        assert len(per_rank) == 2 and all(n > 0 for n in per_rank), per_rank  # both wrote
        assert sum(per_rank) == sum(t.nbytes for t in expected.values())
        back = open_checkpoint(tmp_path / fmt)
        assert set(back.metadata().tensors) == set(expected)
        for k, v in expected.items():
            _same(back.read(k), v)
    assert len(list((tmp_path / "safetensors").glob("model-*-of-*.safetensors"))) > 2


class _FailingSource(ReaderSource):
    def read(self, key, offsets, sizes):
        raise ValueError("injected")


def _ranks_worker(out: Path) -> None:
    """torchrun worker: each format written by 2 ranks; then a failure on rank 1 only."""
    from ckpt_tool._torchrun import exit_cleanly
    from ckpt_tool.parallel import ranks

    r = ranks()
    reader = open_checkpoint(FIXTURES / "mcore016_gpt_tp2pp2_bf16_optim")
    report = {}
    for fmt in ("zarr", "safetensors"):
        if r.is_main:
            (out / fmt).mkdir()
        r.barrier()
        written = []
        writer_for(fmt)(out / fmt, WriterOptions(max_shard_size=100_000)).write(WriteRequest(
            meta=reader.metadata(), source=ReaderSource(reader), common=reader.common(),
            objects=reader.read_object, progress=written.append, ranks=r))
        report[fmt] = r.gather(sum(written))
    if r.is_main:
        (out / "report.json").write_text(json.dumps(report))
        (out / "fail").mkdir()
    r.barrier()
    source = _FailingSource(reader) if r.rank == 1 else ReaderSource(reader)
    try:
        writer_for("zarr")(out / "fail", WriterOptions()).write(WriteRequest(
            meta=reader.metadata(), source=source, common=reader.common(), ranks=r))
    except Exception as exc:  # noqa: BLE001
        print(f"rank {r.rank}: {type(exc).__name__}: {exc}", flush=True)
    exit_cleanly(0)


if __name__ == "__main__":
    _ranks_worker(Path(sys.argv[1]))
