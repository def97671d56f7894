"""``validate``'s bulk path (``_scan_vector``): many DCP items per file, checked together,
against checkpoints written by real writers -- NaN/Inf attributed to the right tensor at item
boundaries, zip headers never counted, damage reported exactly as the per-item path does."""

import shutil
from pathlib import Path

import pytest
import torch

import ckpt_tool.ops.validate._integrity_pass as integrity
import ckpt_tool.ops.validate._scan_item as scan_item
from ckpt_tool.formats.containers.torch_zip.zip_directory import zip_records
from ckpt_tool.ops.inspect import inspect
from ckpt_tool.ops.validate import validate

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _save(tmp_path, sd, writer):
    """``sd`` (name -> tensor) saved by a real writer: PyTorch DCP, or our Megatron-Core-style
    ``dist_checkpointing.save`` (items spread over two ``.distcp`` files)."""
    root = tmp_path / writer
    if writer == "dcp":
        import torch.distributed.checkpoint as dcp_api

        dcp_api.save(sd, checkpoint_id=root, no_dist=True)
    else:
        from ckpt_tool import dist_checkpointing as dc
        from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

        dc.save({k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in sd.items()},
                str(root))
    return root


def _scan(root):
    meta = inspect(root).meta
    sizes = {f: (root / f).stat().st_size
             for f in {c.file for t in meta.tensors.values() for c in t.chunks}}
    stats = {}
    findings, counted = integrity.scan_archives(root, meta, sizes, stats, set(), deep=True)
    return findings, counted, stats


@pytest.fixture
def per_item_calls(monkeypatch):
    """How many archives went through the per-item path (``_check_archive``)."""
    calls = []
    real = scan_item._check_archive
    monkeypatch.setattr(scan_item, "_check_archive",
                        lambda f, item, a, *rest: (calls.append(a.key), real(f, item, a, *rest)))
    return calls


def _per_item_only(monkeypatch):
    """Send every item to the per-item path, as before the bulk path existed."""
    import numpy as np

    monkeypatch.setattr(integrity, "scan_items", lambda maps, file, *a, **k: (
        np.zeros(len(file), bool), np.zeros(len(file), np.int64), np.zeros(len(file), np.int64)))


def _item(root, key):
    """``(path, item offset, its records)`` of the first chunk of ``key``."""
    c = inspect(root).meta.tensors[key].chunks[0]
    blob = (root / c.file).read_bytes()
    return root / c.file, c.byte_offset, zip_records(blob[c.byte_offset:c.byte_offset
                                                          + c.byte_length])


@pytest.mark.parametrize("writer", ["dcp", "mcore"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_bulk_counts_at_tensor_boundaries(tmp_path, writer, dtype, per_item_calls):
    # every tensor ends with a NaN and starts with an Inf, so each item's last element sits
    # next to the next item's first (items are at odd offsets: most are misaligned); one clean
    # tensor in between and an integer tensor must get none of them
    sd = {}
    for i in range(12):
        t = torch.randn(3 + i, 5).to(dtype)
        t.view(-1)[-1], t.view(-1)[0] = float("nan"), float("inf")
        sd[f"layer{i:02d}.weight"] = t
    sd["layer05.weight"] = torch.full((7, 3), 65000.0).to(dtype)  # clean, big values
    sd["layer06.weight"][2, 1] = -float("inf")
    sd["steps"] = torch.arange(10)
    root = _save(tmp_path, sd, writer)
    findings, counted, stats = _scan(root)
    assert findings == [] and per_item_calls == []  # all in bulk
    want = {k: (0, 0) if k in ("layer05.weight", "steps") else (1, 2 if k == "layer06.weight"
                                                                   else 1) for k in sd}
    assert counted == want
    r = validate(root, deep=True)
    assert r.ok and {f.key: f.message for f in r.findings} == {
        k: f"{n} NaN and {i} Inf of {sd[k].numel()} elements"
        for k, (n, i) in want.items() if n or i}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bulk_ignores_nan_patterns_in_zip_headers(tmp_path, dtype, per_item_calls):
    sd = {f"w{i}": torch.randn(4, 4).to(dtype) for i in range(6)}
    root = _save(tmp_path, sd, "dcp")
    nan = torch.tensor([float("nan")] * 2, dtype=dtype).view(torch.uint8).numpy().tobytes()
    poked = 0
    for key in sd:  # the padding of each record's local header ends where its data begins
        path, off, records = _item(root, key)
        blob = bytearray(path.read_bytes())
        for rec in records:
            at = off + rec.start - len(nan)
            if blob[at:at + len(nan)] == b"Z" * len(nan):  # a local header's extra field
                blob[at:at + len(nan)] = nan
                poked += 1
        path.write_bytes(bytes(blob))
    assert poked >= 6 * len(records) - 6  # headers right before every tensor among them
    findings, counted, _ = _scan(root)
    assert findings == [] and counted == {k: (0, 0) for k in sd} and per_item_calls == []
    assert validate(root, deep=True).findings == []


def _flip(path: Path, at: int) -> None:
    blob = bytearray(path.read_bytes())
    blob[at] ^= 0x40
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("record", ["data/0", "data.pkl", "byteorder", "version",
                                    ".data/serialization_id"])
def test_bulk_crc_damage_is_the_per_item_finding(tmp_path, monkeypatch, record):
    sd = {f"w{i}": torch.randn(6, 3) for i in range(8)}
    root = _save(tmp_path, sd, "dcp")
    path, off, records = _item(root, "w5")
    rec = next(r for r in records if r.name.endswith("/" + record))
    _flip(path, off + rec.start + rec.size - 1)
    for deep in (False, True):
        r = validate(root, deep=deep)
        assert [(f.key, f.file) for f in r.errors] == [("w5", path.name)]
        assert "CRC" in r.errors[0].message and rec.name in r.errors[0].message
        assert r.warnings == []  # deep skips a file reported broken
        with monkeypatch.context() as m:
            _per_item_only(m)
            assert validate(root, deep=deep).findings == r.findings


def test_bulk_and_per_item_paths_agree(tmp_path, monkeypatch):
    roots = []
    for src in ("mcore016_gpt_tp2pp2_bf16_optim/iter_0000010", "dcp_plain",
                "mcore016_gpt_tp2pp2_fp32/iter_0000010"):
        root = Path(shutil.copytree(FIXTURES / src, tmp_path / src.split("/")[0]))
        meta = inspect(root).meta
        chunks = sorted((c.file, c.byte_offset, c.byte_length, k)
                        for k, t in meta.tensors.items() for c in t.chunks)
        for file, offset, length, _ in chunks[1::7]:  # damage some items
            _flip(root / file, offset + length // 2)
        roots.append(root)
    for root in roots:
        bulk = _scan(root)
        assert bulk[0] and bulk[1]  # some CRC errors, some tensors counted
        with monkeypatch.context() as m:
            _per_item_only(m)
            assert _scan(root) == bulk


def test_small_tensors_over_many_pools(tmp_path, monkeypatch, per_item_calls):
    import ckpt_tool.ops.validate._scan_count as scan_count

    sd = {f"b{i:02d}": torch.randn(40 + i) for i in range(30)}
    bad = {3: (1, 0), 4: (0, 2), 17: (3, 1), 29: (0, 1)}
    for i, (n, f) in bad.items():
        sd[f"b{i:02d}"][:n] = float("nan")
        sd[f"b{i:02d}"][n:n + f] = -float("inf")
    root = _save(tmp_path, sd, "dcp")
    monkeypatch.setattr(scan_count, "_POOL", 700)  # a few tensors per buffer, one is bigger
    findings, counted, _ = _scan(root)
    assert findings == [] and per_item_calls == []
    assert counted == {f"b{i:02d}": bad.get(i, (0, 0)) for i in range(30)}


def test_finite_agrees_with_counting_on_every_pattern():
    import numpy as np

    from ckpt_tool.ops.validate._checks import _BITS, count_nonfinite
    from ckpt_tool.ops.validate._scan_count import finite

    for dtype, (udt, mask, _, _) in _BITS.items():
        size = np.dtype(udt).itemsize
        if size <= 2:  # every bit pattern
            values = np.arange(1 << (8 * size)).astype(udt)
        else:  # the exponent all ones or all but one, with either sign and a few mantissas
            sign = 1 << (8 * size - 1)
            values = np.array([e | s | m for e in (mask, mask - (mask & -mask), 0)
                               for s in (0, sign) for m in (0, 1, (mask & -mask) >> 1)],
                              dtype=udt)
        for v in values:
            one = np.array([0, v, 0], dtype=udt).tobytes()
            assert finite(one, dtype) == (count_nonfinite(one, dtype) == (0, 0)), (dtype, v)


def test_negative_nan_and_inf_alone_in_a_pool(tmp_path, monkeypatch, per_item_calls):
    import ckpt_tool.ops.validate._scan_count as scan_count

    sd = {f"n{i}": torch.randn(50) for i in range(4)}
    sd["n2"][7] = -float("inf")
    sd["n2"][9] = -float("nan")
    root = _save(tmp_path, sd, "dcp")
    monkeypatch.setattr(scan_count, "_POOL", 250)  # one tensor per buffer
    findings, counted, _ = _scan(root)
    assert findings == [] and per_item_calls == []
    assert counted == {"n0": (0, 0), "n1": (0, 0), "n2": (1, 1), "n3": (0, 0)}


@pytest.mark.parametrize("writer", ["dcp", "mcore"])
def test_mixed_float_dtypes_in_one_file(tmp_path, monkeypatch, writer, per_item_calls):
    import ckpt_tool.ops.validate._scan_count as scan_count

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64]
    sd, want = {}, {}
    for i in range(20):
        t = torch.randn(9 + i, dtype=dtypes[i % len(dtypes)])
        n, f = int(i % 3 == 0), int(i % 4 == 1)
        if n:
            t[-1] = complex("nan+nanj") if t.is_complex() else float("nan")
        if f:
            t[0] = -float("inf")
        sd[f"p{i:02d}"] = t
        want[f"p{i:02d}"] = (2 * n if t.is_complex() else n, f)  # complex: per component
    root = _save(tmp_path, sd, writer)
    for pool in (1 << 20, 200):  # everything in one buffer per dtype, or many
        monkeypatch.setattr(scan_count, "_POOL", pool)
        findings, counted, _ = _scan(root)
        assert findings == [] and per_item_calls == [] and counted == want


@pytest.fixture(params=["one_mapping", "a_mapping_per_file"])
def mapping(request, monkeypatch):
    """The files of a batch mapped back to back in one buffer, or (where libc's mmap cannot be
    called) each on its own."""
    import ckpt_tool.ops._mapped_ranges as m

    if request.param == "a_mapping_per_file":
        monkeypatch.setattr(m, "_mmap_fixed", None)
    elif m._mmap_fixed is None:
        pytest.skip("no libc mmap here")
    return request.param


@pytest.mark.parametrize("populate", [True, False])
def test_map_ranges_holds_the_files_bytes(tmp_path, mapping, populate):
    import mmap

    from ckpt_tool.ops._mapped_ranges import map_ranges, prefault

    blobs = [bytes(range(256)) * (1 + 37 * i) + b"end%d" % i for i in range(4)]
    for i, b in enumerate(blobs):
        (tmp_path / f"f{i}").write_bytes(b)
    g = mmap.ALLOCATIONGRANULARITY
    big = bytes(range(7, 250)) * (3 * g // 243 + 1)
    (tmp_path / "big").write_bytes(big)
    ranges = [(tmp_path / f"f{i}", 0, len(b)) for i, b in enumerate(blobs)]
    ranges += [(tmp_path / "missing", 0, 10), (tmp_path / "f0", 0, len(blobs[0]) + 1),
               (tmp_path / "big", g, 3 * g - 5)]
    regions = map_ranges(ranges, populate)
    try:
        seen = {}
        for region, at in regions:
            if not populate:
                prefault(region)  # (page tables filled by another thread in the scan)
            assert len(at) == len(ranges)
            for i, place in enumerate(at):
                if place is not None:
                    assert i not in seen
                    seen[i] = region[place:place + ranges[i][2] - ranges[i][1]]
        assert seen == {**{i: b for i, b in enumerate(blobs)}, 6: big[g:3 * g - 5]}
        assert (len(regions) == 1) == (mapping == "one_mapping")
    finally:
        for region, _ in regions:
            region.close()


def test_bulk_path_with_either_mapping(tmp_path, mapping, monkeypatch, per_item_calls):
    sd = {f"w{i}": torch.randn(5, 2 + i) for i in range(10)}
    sd["w4"][0, 0] = float("nan")
    root = _save(tmp_path, sd, "mcore")
    findings, counted, stats = _scan(root)
    assert findings == [] and per_item_calls == [] and stats["zip_items_checked"] == 10
    assert counted == {k: (1, 0) if k == "w4" else (0, 0) for k in sd}
    path, off, records = _item(root, "w7")
    rec = next(r for r in records if r.name.endswith("/data/0"))
    _flip(path, off + rec.start)
    r = validate(root)
    assert [(f.key, f.file) for f in r.errors] == [("w7", path.name)] and per_item_calls
    with monkeypatch.context() as m:
        _per_item_only(m)
        assert validate(root).findings == r.findings


def test_batches_mapped_ahead_and_unmapped_behind(tmp_path, monkeypatch, per_item_calls):
    """Many small batches, each mapped while the last is checked (page tables filled, then
    unmapped, by the helper thread): the same findings and counts as item by item, and every
    mapping prefaulted and closed."""
    import torch.distributed.checkpoint as dcp_api
    from torch.distributed.checkpoint import FileSystemWriter

    import ckpt_tool.ops._mapped_ranges as mapping_mod

    sd = {f"t{i:02d}": torch.randn(30 + i) for i in range(24)}
    sd["t05"][3] = float("nan")
    sd["t19"][:2] = -float("inf")
    root = tmp_path / "many"
    dcp_api.save(sd, storage_writer=FileSystemWriter(root, thread_count=6), no_dist=True)
    path, off, records = _item(root, "t21")
    assert len(list(root.glob("*.distcp"))) == 6
    _flip(path, off + next(r for r in records if r.name.endswith("/data/0")).start)
    mapped, prefaulted = [], []
    real_map, real_prefault = integrity.map_ranges, mapping_mod.prefault
    monkeypatch.setattr(integrity, "map_ranges", lambda *a: _record(real_map, mapped, *a))
    monkeypatch.setattr(integrity, "prefault", lambda r: (prefaulted.append(r),
                                                          real_prefault(r))[1])
    monkeypatch.setattr(integrity, "_BATCH_UNITS", 2)  # batches of 1, 2, 2, 1 files
    findings, counted, stats = _scan(root)
    assert [(f.key, f.file) for f in findings] == [("t21", path.name)] and per_item_calls
    assert counted == {k: (1, 0) if k == "t05" else (0, 2) if k == "t19" else (0, 0)
                       for k in sd}  # (t21 too, as item by item: validate drops it)
    assert len(mapped) >= 4 and all(r.closed for r in mapped)
    assert {id(r) for r in prefaulted} == {id(r) for r in mapped}
    with monkeypatch.context() as m:
        _per_item_only(m)
        assert _scan(root)[:2] == (findings, counted)


def _record(real_map, mapped, *args):
    regions = real_map(*args)
    mapped.extend(r for r, _ in regions)
    return regions


def test_describe_all_describes_each_distinct_pickle_once():
    import numpy as np

    from ckpt_tool._crc import crc32
    from ckpt_tool.ops.validate._scan_count import byte_rows, describe_all

    recs = [b"alpha-pickle", b"alpha-pickle", b"beta", b"alpha-pickle", b"alphA-pickle", b"beta"]
    blob = b"".join(b"~" * 3 + r for r in recs)
    start, at = [], 0
    for r in recs:
        start.append(at + 3)
        at += 3 + len(r)
    arr = np.frombuffer(blob, np.uint8)
    start, size = np.array(start), np.array([len(r) for r in recs])
    crc = np.array([crc32(b"alpha-pickle" if r == b"alphA-pickle" else r) for r in recs],
                   np.uint32)  # the 5th: bytes changed, CRC as recorded for the 1st
    seen = []
    ids, infos = describe_all(arr, start, size, crc, lambda raw: seen.append(raw) or len(raw))
    assert sorted(seen) == [b"alpha-pickle", b"beta"]
    got = [infos[i] for i in ids]
    assert got[:4] + got[5:] == [(crc32(r), len(r)) for r in recs[:4] + recs[5:]]
    assert got[4] == (-1, None)  # same size and recorded CRC, other bytes: not described
    assert byte_rows(arr, start[2:3], 4).tobytes() == b"beta"
    assert byte_rows(arr, np.array([-5, len(blob)]), 3).tolist() == [[126] * 3, list(blob[-3:])]
    assert byte_rows(arr, start, len(blob) + 1).shape == (6, len(blob) + 1)
