"""``ops.diff._windows``: threaded byte comparison of real checkpoint items, one flipped byte."""

import shutil
import threading
from pathlib import Path

import pytest

import ckpt_tool.ops.diff._windows as dw
from _items import refresh_crcs
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.ops.diff import diff

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
FILE = "__0_1.distcp"  # 41 DCP items stored back to back


def _items(root: Path) -> list[tuple[int, int]]:
    """``(offset, length)`` of every item stored in ``FILE``, by offset."""
    with open_checkpoint(root) as r:
        return sorted((c.byte_offset, c.byte_length) for t in r.metadata().tensors.values()
                      for c in t.chunks if c.file == FILE)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def copy(tmp_path):
    return Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))


@pytest.mark.parametrize("block", [4096, 1 << 20])  # several windows per item; all in one unit
def test_one_flipped_byte_in_first_and_last_window(copy, monkeypatch, block):
    items = _items(MCORE)
    assert len(items) > 10 and all(o + n == o2 for (o, n), (o2, _) in zip(items, items[1:]))
    first, last = 3, len(items) - 2  # the first byte of one item, the last byte of another
    _flip(copy / FILE, items[first][0])
    _flip(copy / FILE, items[last][0] + items[last][1] - 1)
    monkeypatch.setattr(dw, "_BLOCK", block)
    monkeypatch.setattr(dw, "_threads", lambda nbytes: 2)
    specs = [(MCORE / FILE, o, [(0, n)], copy / FILE, o) for o, n in items]
    done, names = [], set()
    real_equal = dw._Bytes.equal

    def equal(self, unit, skip):
        names.add(threading.current_thread().name)
        return real_equal(self, unit, skip)

    monkeypatch.setattr(dw._Bytes, "equal", equal)
    ok = dw.compare_all(specs, done.append)
    assert [i for i, v in enumerate(ok) if not v] == [first, last]
    assert sorted(done) == [i for i in range(len(items)) if i not in (first, last)]
    assert names and all(n.startswith("ckpt-diff-") for n in names)  # the threads compared


def test_runs_against_contiguous_bytes_and_short_file(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    data = bytes(range(256)) * 64
    a.write_bytes(data)
    b.write_bytes(data[100:200] + data[1000:1100] + data[:10])
    ok = dw.compare_all([(a, 0, [(100, 100), (1000, 100)], b, 0),  # two runs of A, one of B
                         (a, 0, [(0, 10)], b, 200),
                         (a, 0, [(0, 10)], b, 201),  # shifted by one byte
                         (a, 0, [(0, 64)], b, 200),  # B ends first
                         (a, 5, [], b, 0)], lambda i: None)  # nothing to compare
    assert ok == [True, True, False, False, True]


def test_threads_follow_cpus_and_torchrun_ranks(monkeypatch):
    monkeypatch.setattr(dw.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert dw._threads(1 << 40) == dw._MAX_THREADS == 4
    assert dw._threads(dw._BLOCK // 2) == 1  # one window of work: no second thread
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # four ranks share the node's 8 CPUs
    assert dw._threads(1 << 40) == 2


@pytest.mark.parametrize("index", [(0, 0), (63, 63)])
def test_diff_finds_one_element_in_first_or_last_window(copy, monkeypatch, index):
    """Two threads, items cut in 2 KiB windows: the element at either end of a chunk."""
    import io
    import math
    import struct
    import zipfile

    monkeypatch.setattr(dw, "_BLOCK", 4096)
    monkeypatch.setattr(dw, "_threads", lambda nbytes: 2)
    with open_checkpoint(copy) as r:
        chunk = next(c for c in r.metadata().tensors["output_layer.weight"].chunks
                     if c.offsets == (0, 0))
    path = copy / chunk.file
    item = path.read_bytes()[chunk.byte_offset:chunk.byte_offset + chunk.byte_length]
    info = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                if i.filename.endswith("/data/0"))
    n, m = struct.unpack("<HH", item[info.header_offset + 26:info.header_offset + 30])
    flat = index[0] * 64 + index[1]
    at = chunk.byte_offset + info.header_offset + 30 + n + m + 4 * flat
    windows = math.ceil(chunk.byte_length / 2048)
    assert windows > 4 and (at - chunk.byte_offset) // 2048 in (0, 1, windows - 2, windows - 1)
    data = bytearray(path.read_bytes())
    data[at:at + 4] = struct.pack("<f", 42.0)
    path.write_bytes(bytes(data))
    refresh_crcs(path, chunk.byte_offset, chunk.byte_length)  # (an intact item)
    r = diff(MCORE, copy)
    (v,) = r.values
    assert v.key == "output_layer.weight" and v.differing == 1 and v.first_index == index
    assert v.first_b == 42.0 and r.stats["tensors_equal_bytes"] == 16
