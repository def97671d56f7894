"""ckpt_tool's own zarr v2 writer (formats/mcore_dist/zarr_v2.py): the bytes zarr-python 2 wrote
for Megatron-Core, with zarr-python 2, 3 or none installed.

The byte-for-byte comparison with the real Megatron-Core 0.15.3 (zarr-python 2) is in
tests/interop/test_mcore_zarr.py; here: the header encoding, region and coordinate writes,
edge chunks, locks, refusals, and (when zarr-python 2 is installed) the same bytes as it.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest

from ckpt_tool.errors import CheckpointingException
from ckpt_tool.formats.mcore_dist.zarr_v2 import ChunkLocks, V2Array, encode_header

try:
    import zarr

    ZARR2 = zarr.__version__.startswith("2.")
except ImportError:  # pragma: no cover - zarr is a test dependency
    ZARR2 = False

# What zarr-python 2.18 wrote for zarr.create((5, 3), dtype="<f4", chunks=(2, 3),
# compressor=None, fill_value=None) (no final newline)
F4_HEADER = (b'{\n    "chunks": [\n        2,\n        3\n    ],\n    "compressor": null,\n'
             b'    "dtype": "<f4",\n    "fill_value": null,\n    "filters": null,\n'
             b'    "order": "C",\n    "shape": [\n        5,\n        3\n    ],\n'
             b'    "zarr_format": 2\n}')


def _ts_read(path: Path) -> np.ndarray:
    import tensorstore as ts

    spec = {"driver": "zarr", "metadata_key": ".zarray",
            "kvstore": {"driver": "file", "path": str(path)}}
    return ts.open(spec, open=True).result().read().result()


def test_header_bytes_are_zarr_python_2s():
    assert encode_header((5, 3), (2, 3), "<f4") == F4_HEADER


def test_region_writes_pad_edge_chunks_with_zeros(tmp_path):
    ref = np.arange(15, dtype="<f4").reshape(5, 3)
    arr = V2Array.create(tmp_path / "a", (5, 3), (2, 3), np.dtype("<f4"), "<f4")
    arr[0:3, :] = ref[0:3]          # chunk 0 whole, chunk 1 partly
    arr[(slice(3, 5), slice(0, 3))] = ref[3:5]
    assert (tmp_path / "a" / ".zarray").read_bytes() == F4_HEADER
    assert sorted(os.listdir(tmp_path / "a")) == [".zarray", "0.0", "1.0", "2.0"]
    edge = np.frombuffer((tmp_path / "a" / "2.0").read_bytes(), "<f4")
    assert edge.tolist() == ref[4].tolist() + [0.0] * 3  # padded to the chunk shape
    assert np.array_equal(_ts_read(tmp_path / "a"), ref)


def test_integer_axes_and_coordinates(tmp_path):
    # a stacked layer (prepend axis: an integer in the selection), then a flattened write
    arr = V2Array.create(tmp_path / "s", (2, 3, 4), (1, 3, 4), np.dtype("<i8"), "<i8")
    layer = np.arange(12, dtype="<i8").reshape(3, 4)
    arr[1, 0:3, 0:4] = layer
    assert sorted(os.listdir(tmp_path / "s")) == [".zarray", "1.0.0"]
    flat = V2Array.create(tmp_path / "f", (4, 6), (2, 6), np.dtype("<f2"), "<f2",
                          locks=ChunkLocks(tmp_path / "f.sync"))
    ref = np.arange(24, dtype="<f2").reshape(4, 6)
    points = np.unravel_index(np.arange(5, 19), ref.shape)  # across chunks 0 and 1
    flat.set_coordinate_selection(points, ref[points])
    got = _ts_read(tmp_path / "f")
    mask = np.zeros(24, bool)
    mask[5:19] = True
    assert np.array_equal(got.reshape(-1)[mask], ref.reshape(-1)[mask])
    assert not got.reshape(-1)[~mask].any()
    assert sorted(os.listdir(tmp_path / "f.sync")) == [".zarray", "0.0", "1.0"]


def _write_half(path: str, parity: int) -> None:
    arr = V2Array(path, (1, 400), (1, 400), np.dtype("<i4"), ChunkLocks(path + ".sync"))
    for i in range(parity, 400, 2):  # every write rewrites the one chunk
        arr.set_coordinate_selection(([0], [i]), np.array([i + 1], "<i4"))


def test_locks_keep_concurrent_writers_of_one_chunk(tmp_path):
    path = str(tmp_path / "c")
    V2Array.create(path, (1, 400), (1, 400), np.dtype("<i4"), "<i4")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_half, args=(path, p)) for p in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = np.frombuffer(Path(path, "0.0").read_bytes(), "<i4")
    assert got.tolist() == list(range(1, 401))  # no update lost


def test_refusals(tmp_path):
    V2Array.create(tmp_path / "a", (4,), (2,), np.dtype("<f4"), "<f4")
    with pytest.raises(CheckpointingException, match="already exists"):
        V2Array.create(tmp_path / "a", (4,), (2,), np.dtype("<f4"), "<f4")
    (tmp_path / "a" / "0").write_bytes(b"\0" * 3)  # truncated chunk file
    arr = V2Array(tmp_path / "a", (4,), (2,), np.dtype("<f4"))
    with pytest.raises(CheckpointingException, match="has 3 bytes, expected 8"):
        arr[0:1] = np.ones(1, "<f4")
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / ".zarray").write_text(
        '{"chunks": [2], "compressor": {"id": "blosc"}, "dtype": "<f4", "fill_value": 0, '
        '"filters": null, "order": "C", "shape": [4], "zarr_format": 2}')
    with pytest.raises(CheckpointingException, match="compressed"):
        V2Array.header(tmp_path / "z")


@pytest.mark.skipif(not ZARR2, reason="needs zarr-python 2 (the library Megatron-Core wrote with)")
def test_same_bytes_as_zarr_python_2(tmp_path):
    g = np.random.default_rng(0)
    for dt, shape, chunks in (("<f4", (5, 3), (2, 3)), ("|b1", (3, 4), (3, 2)),
                              ("<i8", (), ()), ("|u1", (7,), (3,)), ("<c16", (2, 2), (1, 2))):
        ref = (g.random(shape) * 100).astype(dt)
        theirs = zarr.create(shape, dtype=dt, store=str(tmp_path / f"z{dt[1:]}"), chunks=chunks,
                             compressor=None, fill_value=None, write_empty_chunks=True)
        ours = V2Array.create(tmp_path / f"o{dt[1:]}", shape, chunks, np.dtype(dt), dt)
        theirs[...] = ref
        ours[tuple(slice(0, n) for n in shape)] = ref
        names = sorted(os.listdir(tmp_path / f"z{dt[1:]}"))
        assert names == sorted(os.listdir(tmp_path / f"o{dt[1:]}")), dt
        for name in names:
            assert (tmp_path / f"z{dt[1:]}" / name).read_bytes() == \
                (tmp_path / f"o{dt[1:]}" / name).read_bytes(), (dt, name)
    # flattened writes of two halves under a synchronizer, as Megatron-Core did
    theirs = zarr.create((4, 6), dtype="<f4", store=str(tmp_path / "zf"), chunks=(2, 6),
                         compressor=None, fill_value=None, write_empty_chunks=True,
                         synchronizer=zarr.ProcessSynchronizer(str(tmp_path / "zf.sync")))
    ours = V2Array.create(tmp_path / "of", (4, 6), (2, 6), np.dtype("<f4"), "<f4",
                          locks=ChunkLocks(tmp_path / "of.sync"))
    ref = np.arange(24, dtype="<f4").reshape(4, 6)
    for half in (slice(0, 7), slice(7, 12)):
        points = np.unravel_index(np.arange(24)[half], ref.shape)
        theirs.set_coordinate_selection(points, ref[points])
        ours.set_coordinate_selection(points, ref[points])
    for name in (".zarray", "0.0"):
        assert (tmp_path / "zf" / name).read_bytes() == (tmp_path / "of" / name).read_bytes()
    assert sorted(os.listdir(tmp_path / "zf")) == sorted(os.listdir(tmp_path / "of"))
    assert sorted(os.listdir(tmp_path / "zf.sync")) == sorted(os.listdir(tmp_path / "of.sync"))
