"""Our torch.save archive of one tensor is torch.save's, byte for byte (formats/torch_zip_write)."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from ckpt_tool.formats.containers.torch_zip.torch_zip_read import raw_item  # noqa: E402
from ckpt_tool.formats.containers.torch_zip.zip_directory import zip_records  # noqa: E402
from ckpt_tool.formats.containers.torch_zip.torch_zip_write import (STORAGE_TYPES, TensorArchive,  # noqa: E402
                                               contiguous_stride, supported, tensor_pickle)
from ckpt_tool.formats.write_pieces import tensor_bytes  # noqa: E402

SHAPES = [(), (0,), (1,), (10,), (3, 4), (2, 3, 4), (5, 0, 2, 3), (1, 1, 1, 1, 1), (300, 700),
          (0, 3), (257, 3), (70000, 2)]


def _torch_save(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _ours(t) -> bytes:
    out = io.BytesIO()
    archive = TensorArchive(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.nbytes)
    n = archive.write(out.write, tensor_bytes(t) if t.numel() else b"")
    assert n == len(out.getvalue())
    return out.getvalue()


@pytest.mark.parametrize("dtype", sorted(STORAGE_TYPES))
def test_same_bytes_as_torch_save(dtype):
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        t = (torch.rand(shape, generator=gen) * 100).to(getattr(torch, dtype))
        assert _ours(t) == _torch_save(t), (dtype, shape)


def test_large_dims_and_storage_sizes_pickle_as_torch_does():
    # ints of every pickle width: BININT1, BININT2, BININT, LONG1 (no data: a size-0 dim)
    for shape in [(2**31 + 5, 0), (65535, 0, 3), (2**40, 0), (0, 2**33, 7)]:
        t = torch.empty(shape)
        assert _ours(t) == _torch_save(t), shape
    t = torch.zeros(70000, dtype=torch.int8)  # a storage numel past BININT2
    assert _ours(t) == _torch_save(t)


def test_head_does_not_depend_on_the_data_and_tail_on_the_crc():
    a, b = torch.zeros(100), torch.ones(100)
    archive = TensorArchive("float32", (100,), 400)
    assert _ours(a).startswith(archive.head()) and _ours(b).startswith(archive.head())
    assert _ours(a)[len(archive.head()) + 400:] != _ours(b)[len(archive.head()) + 400:]


def test_archives_load_and_read_in_place():
    t = torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4)
    data = _ours(t)
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True), t)
    raw = raw_item(data)
    assert (raw.dtype, raw.shape, raw.stride) == ("bfloat16", (2, 3, 4), (12, 4, 1))
    assert all(r.start % 64 == 0 for r in zip_records(data))


def test_data_must_match_the_announced_size():
    with pytest.raises(ValueError):
        TensorArchive("float32", (4,), 16).write(io.BytesIO().write, b"\0" * 12)


def test_what_is_left_to_torch_save():
    assert supported("bfloat16", 10**9)
    assert not supported("bfloat16", 2**32)  # ZIP64 headers: torch.save writes those
    assert not supported("float8_e4m3fn", 16)  # its data.pkl names no storage class
    assert not supported("uint16", 16)
    with pytest.raises(ValueError):
        TensorArchive("float8_e4m3fn", (4,), 4)


def test_contiguous_strides_count_empty_dims_as_one():
    assert contiguous_stride((5, 0, 2, 3)) == torch.empty(5, 0, 2, 3).stride()
    assert contiguous_stride(()) == ()
    assert tensor_pickle("float32", (2, 2)).startswith(b"\x80\x02ctorch._utils\n")


# -- the .distcp files of the streaming writers ------------------------------------------------

def _write_dcp(tmp_path, tensors: dict, source_read):
    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
    from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta

    metas = {k: TensorMeta(k, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                           (ChunkRef((0,) * t.dim(), tuple(t.shape)),))
             for k, t in tensors.items()}
    out = tmp_path / "out"
    out.mkdir()

    class Src:
        def read(self, key, offsets, sizes):
            return source_read(tensors[key])

    req = WriteRequest(meta=CheckpointMeta(format="t", root="", tensors=metas), source=Src())
    writer_for("dcp")(out, WriterOptions(extra={"files": 1})).write(req)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("as_numpy", [False, True])
def test_every_distcp_item_is_torch_save_of_its_chunk(tmp_path, as_numpy):
    import numpy as np
    from ckpt_tool.formats import open_checkpoint

    tensors = {"a": torch.randn(33, 17), "b": torch.arange(12, dtype=torch.int64),
               "c": torch.randn(5, 6).to(torch.bfloat16), "e": torch.zeros(0, 4),
               "f8": torch.randn(8).to(torch.float8_e4m3fn)}  # float8: through torch.save

    def read(t):
        if not as_numpy:
            return t.clone()
        u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
        return t.contiguous().view(torch.uint8).numpy().view(u).reshape(tuple(t.shape)).copy()

    out = _write_dcp(tmp_path, tensors, read)
    meta = open_checkpoint(out).metadata()
    for key, t in tensors.items():
        (chunk,) = meta.tensors[key].chunks
        with open(out / chunk.file, "rb") as f:
            f.seek(chunk.byte_offset)
            item = f.read(chunk.byte_length)
        assert item == _torch_save(t), key
    with open_checkpoint(out) as r:
        for key, t in tensors.items():
            assert r.read(key).view(torch.uint8).equal(t.view(torch.uint8)), key
