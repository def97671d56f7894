"""``torch_zip_read``: zip records and zero-copy tensor views of torch.save archives, checked bitwise
against ``torch.load`` on every DCP-based fixture and on odd tensors built with torch.save."""

import hashlib
import io
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_tool.formats.containers.dcp import dcp_items as _dcp_io
from ckpt_tool.formats.containers.dcp.dcp_items import load_chunk, read_item_bytes
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import as_tensor, raw_item
from ckpt_tool.formats.containers.torch_zip.zip_directory import NotSimple, zip_records
from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file
from ckpt_tool.ops.validate._checks import NonfiniteBatch, count_nonfinite, nonfinite
from ckpt_tool.ops.inspect import inspect

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DCP_FIXTURES = [FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010",
                FIXTURES / "mcore016_gpt_tp2pp2_bf16_optim" / "iter_0000010",
                FIXTURES / "mcore015_gpt_flattened_optim" / "iter_0000010",
                FIXTURES / "dcp_plain"]


def _same(a, b):
    """Bitwise equal, with the same dtype, shape, stride and storage offset."""
    assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
        (b.dtype, b.shape, b.stride(), b.storage_offset())
    x, y = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _saved(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _tensor_chunks(root):
    meta = inspect(root).meta
    return [c for t in meta.tensors.values() for c in t.chunks if c.layout != "raw"]


@pytest.mark.parametrize("root", DCP_FIXTURES, ids=lambda p: p.parts[-2 if p.name.startswith(
    "iter") else -1])
def test_every_fixture_item_reads_raw_bitwise(root, monkeypatch):
    chunks = _tensor_chunks(root)
    assert chunks
    dtypes = set()
    for c in chunks:
        blob = read_item_bytes(root, c.file, c.byte_offset, c.byte_length)
        want = load_torch_file(io.BytesIO(blob), trust=False)
        raw = raw_item(memoryview(blob))  # never NotSimple on what the real writers wrote
        _same(as_tensor(raw), want)
        _same(as_tensor(raw, copy=True), want)
        _same(load_chunk(root, c), want)
        dtypes.add(raw.dtype)
    monkeypatch.setattr(_dcp_io, "_PREAD_MAX", 0)  # the mmap path of load_chunk
    for c in chunks[:20]:
        blob = read_item_bytes(root, c.file, c.byte_offset, c.byte_length)
        _same(load_chunk(root, c), load_torch_file(io.BytesIO(blob)))
    if "bf16" in str(root):
        assert "bfloat16" in dtypes


ODD = {
    "bf16": lambda: torch.randn(5, 7).bfloat16(),
    "fp16": lambda: torch.randn(3, 3).half(),
    "int64": lambda: torch.arange(10),
    "bool": lambda: torch.rand(9) > 0.5,
    "complex64": lambda: torch.randn(4, dtype=torch.complex64),
    "float64": lambda: torch.randn(2, 3, dtype=torch.float64),
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 4),
    "transposed": lambda: torch.randn(4, 6).t(),
    "slice_of_storage": lambda: torch.randn(10, 4)[3:7],
    "every_other": lambda: torch.randn(12)[::2],
    "expanded": lambda: torch.randn(1, 5).expand(3, 5),
    "float8": lambda: torch.randn(8).to(torch.float8_e4m3fn),
    "uint16": lambda: torch.arange(6).to(torch.uint16),
}


@pytest.mark.parametrize("name", sorted(ODD))
@pytest.mark.parametrize("shift", [0, 1, 3])
def test_odd_tensors_and_misaligned_placement(name, shift):
    t = ODD[name]()
    blob = _saved(t)
    want = torch.load(io.BytesIO(blob), weights_only=True)
    buf = memoryview(bytes(shift) + blob + b"tail")  # the item at an odd offset of its file
    raw = raw_item(buf[shift:shift + len(blob)])
    _same(as_tensor(raw), want)
    _same(as_tensor(raw, copy=True), want)
    if name in ("expanded", "every_other"):
        assert raw.dense_span() is None
    elif name == "slice_of_storage":
        assert raw.dense_span() == (12, 28)
    else:
        assert raw.dense_span() == (0, t.numel())


def test_zip64_directory_is_followed(monkeypatch):
    t = torch.randn(6, 5).bfloat16()
    blob = _saved(t)
    out = io.BytesIO()
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 0)  # every size and offset in ZIP64 extras
    with zipfile.ZipFile(io.BytesIO(blob)) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), zipfile.ZIP_STORED)
    repacked = out.getvalue()
    assert b"PK\x06\x06" in repacked
    records = zip_records(repacked)
    assert {r.name for r in records} == set(zipfile.ZipFile(io.BytesIO(blob)).namelist())
    _same(as_tensor(raw_item(repacked)), t)


def test_unusual_archives_are_not_simple():
    blob = _saved(torch.randn(64))
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(NotSimple):
        raw_item(out.getvalue())  # compressed storage record
    with pytest.raises(NotSimple):
        raw_item(blob[:-30])  # truncated: no end record
    with pytest.raises(NotSimple):
        raw_item(_saved({"a": torch.zeros(2), "b": torch.ones(2)}))  # not one tensor
    big = bytearray(blob)
    at = big.index(b"little")
    big[at:at + 6] = b"big\n\n\n"
    with pytest.raises(NotSimple):
        raw_item(bytes(big))


def test_load_chunk_returns_a_private_copy(tmp_path):
    import torch.distributed.checkpoint as dcp_api

    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp_api.save({"w": w}, checkpoint_id=tmp_path / "ck", no_dist=True)
    c = _tensor_chunks(tmp_path / "ck")[0]
    before = hashlib.sha256((tmp_path / "ck" / c.file).read_bytes()).hexdigest()
    t = load_chunk(tmp_path / "ck", c)
    assert torch.equal(t, w)
    t.fill_(7.0)  # writable, and the file does not change
    assert hashlib.sha256((tmp_path / "ck" / c.file).read_bytes()).hexdigest() == before
    assert torch.equal(load_chunk(tmp_path / "ck", c), w)


def test_load_chunk_falls_back_for_unusual_items(tmp_path, monkeypatch):
    from ckpt_tool.formats.containers.pickle import safe_pickle as _pickle
    from ckpt_tool.model import ChunkRef

    t = torch.randn(5, 3)
    payload = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(_saved(t))) as src, \
            zipfile.ZipFile(payload, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():  # compressed records: only torch.load reads them
            dst.writestr(info.filename, src.read(info))
    (tmp_path / "f.distcp").write_bytes(b"pad" + payload.getvalue())
    c = ChunkRef((0, 0), (5, 3), "f.distcp", 3, len(payload.getvalue()), layout="torch_save")
    calls = []
    real = _pickle.load_torch_file
    monkeypatch.setattr(_pickle, "load_torch_file",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(load_chunk(tmp_path, c), t) and calls == [1]
    plain = ChunkRef((0, 0), (5, 3), "g.distcp", 0, len(_saved(t)), layout="torch_save")
    (tmp_path / "g.distcp").write_bytes(_saved(t))
    assert torch.equal(load_chunk(tmp_path, plain), t) and calls == [1]  # raw path: no torch.load


def test_nonfinite_counts():
    x = torch.zeros(1000)
    x[[1, 5, 9]] = float("nan")
    x[7] = float("inf")
    x[8] = -float("inf")
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert nonfinite(x.to(dt)) == (3, 2)
    assert nonfinite(torch.full((100_000,), 60000.0, dtype=torch.float16)) == (0, 0)  # sum overflows
    assert nonfinite(torch.full((10,), 3e38)) == (0, 0)
    assert nonfinite(torch.arange(5)) == (0, 0)
    c = torch.zeros(4, dtype=torch.complex64)
    c[2] = complex(float("nan"), 1.0)
    assert nonfinite(c) == (1, 0)


def _bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "complex64",
                                   "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz",
                                   "float8_e5m2fnuz"])
@pytest.mark.parametrize("shift", [0, 1])
def test_count_nonfinite_on_raw_bytes_matches_torch(dtype, shift):
    dt = getattr(torch, dtype)
    x = torch.randn(5000) * 3
    x[[10, 20, 4999]] = float("nan")
    x[[30, 31]] = float("inf")
    x[40] = -float("inf")
    t = x.to(dt) if not dt.is_complex else torch.complex(x, torch.zeros_like(x)).to(dt)
    ref = torch.view_as_real(t) if dt.is_complex else t.float()
    want = (int(torch.isnan(ref).sum()), int(torch.isinf(ref).sum()))
    assert want[0] > 0
    blob = memoryview(bytes(shift) + _bytes(t))[shift:]  # any alignment
    assert count_nonfinite(blob, dtype) == want
    big = torch.finfo(torch.float32 if dt == torch.complex64 else dt).max
    clean = _bytes(torch.full((300,), big, dtype=dt))  # the largest finite: sums overflow
    assert count_nonfinite(clean, dtype) == (0, 0)


def test_nonfinite_batch_reports_each_member():
    got = {}
    batch = NonfiniteBatch(lambda tag, n, i: got.__setitem__(tag, (n, i)), capacity=64)
    clean = torch.ones(8).numpy().tobytes()
    dirty = torch.tensor([1.0, float("nan"), float("inf"), 2.0]).numpy().tobytes()
    for i in range(10):  # several flushes of a 64-byte buffer
        batch.add(f"c{i}", clean, "float32")
    batch.add("d", dirty, "float32")
    batch.add("h", torch.tensor([float("nan")] * 3).half().numpy().tobytes(), "float16")
    batch.add("i", bytes(16), "int64")
    batch.add("big", torch.full((40,), float("inf")).numpy().tobytes(), "float32")
    batch.flush()
    assert got == {**{f"c{i}": (0, 0) for i in range(10)}, "d": (1, 1), "h": (3, 0),
                   "i": (0, 0), "big": (0, 40)}


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_misaligned_item_slices_copy_only_the_slice(tmp_path, shift, dtype):
    """A mapped item at an odd file offset is handed out as its bytes in place (ByteView), not
    aligned by copying the whole item; ``assemble`` copies just the region asked for, and the
    values are bitwise those of torch.load."""
    from ckpt_tool.formats.containers.dcp.dcp_items import ByteView, assemble, load_chunk_view
    from ckpt_tool.model import ChunkRef, TensorMeta

    t = torch.randn(4, 512, 300).to(dtype)  # > 1 MiB: the mapped path
    blob = _saved(t)
    (tmp_path / "f.distcp").write_bytes(bytes(4096 + shift) + blob + b"tail")
    name = str(dtype).removeprefix("torch.")
    chunk = ChunkRef(offsets=(0, 0, 0), sizes=(4, 512, 300), file="f.distcp",
                     byte_offset=4096 + shift, byte_length=len(blob))
    view = load_chunk_view(tmp_path, chunk)
    assert isinstance(view, ByteView) == bool(shift % t.element_size())
    if isinstance(view, ByteView):
        _same(view.materialize(), t)
    meta = TensorMeta(key="w", dtype=name, shape=(4, 512, 300), chunks=(chunk,))
    for sl in [None, (slice(2, 3),), (slice(1, 3), slice(100, 200)),
               (slice(0, 4), slice(0, 512), slice(7, 9))]:
        want = t if sl is None else t[sl]
        _same(assemble(meta, sl, lambda c: load_chunk_view(tmp_path, c)),
              want.clone(memory_format=torch.contiguous_format))
