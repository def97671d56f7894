"""The bulk path of ``validate``'s integrity pass: many DCP items checked at once.

A DCP checkpoint stores every tensor piece as its own ``torch.save`` zip inside a ``.distcp``
file: thousands of items, most a few KB. Parsing each with Python objects costs more than its
bytes, so :func:`scan_items` handles a batch of files, mapped back to back in one buffer
(``_mapped_ranges``), with a fixed number of numpy operations per phase, whatever the number of
items:

1. every item's end-of-central-directory record (its last 22 bytes) in one gather;
2. central directories grouped by (entries, size), each group matched byte for byte against a
   template (a member parsed with ``struct``) except the per-record fields (CRC, sizes, local
   header offset), which are then read column-wise;
3. the local headers (signature, name and extra lengths): where each record's data starts;
4. the tensor's ``data.pkl`` described once per distinct content (``torch_zip_read._describe``);
5. records of a few bytes that are the same in every item (format version, byte order, ...)
   compared byte for byte, one CRC32 for all; one CRC32 call for each other record;
6. each small tensor copied, right after its record's CRC (while in cache), into a per-dtype
   buffer tested for NaN/Inf once per megabyte (``_scan_count``; members counted apart only
   when it is not all finite); big ones counted in place, slab by slab.

An item the bulk path cannot prove plain and intact (an unusual zip, a CRC mismatch, a tensor
it cannot count in place) is marked for the per-item path, which gives the verdict and the
message: the findings do not depend on which path checked an item.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from ckpt_tool._crc import crc32
from ckpt_tool.formats.containers.torch_zip.torch_zip_read import RawItem, _describe
from ckpt_tool.formats.containers.torch_zip.zip_directory import (NotSimple, entry_flags_problem,
                                                                  version_problem)
from ckpt_tool.model import DTYPE_ITEMSIZE
from ckpt_tool.ops.validate._scan_count import (_BITS, big_tensor, crc_and_pool, crc_records,
                                                byte_rows, describe_all)

__all__ = ["scan_items"]

_MAX32 = 0xFFFFFFFF
_EOCD = np.dtype([("sig", "<u4"), ("disk", "<u2"), ("cd_disk", "<u2"), ("n_disk", "<u2"),
                  ("count", "<u2"), ("cd_size", "<u4"), ("cd_off", "<u4"), ("clen", "<u2")])
_LOC64 = np.dtype([("sig", "<u4"), ("disk", "<u4"), ("off", "<u8"), ("disks", "<u4")])
_EOCD64 = np.dtype([("sig", "<u4"), ("size", "<u8"), ("made", "<u2"), ("need", "<u2"),
                    ("disk", "<u4"), ("cd_disk", "<u4"), ("n_disk", "<u8"), ("count", "<u8"),
                    ("cd_size", "<u8"), ("cd_off", "<u8")])
# signature, flags, method; name/extra/comment lengths, disk; external attributes
_ENTRY = struct.Struct("<4s4xHH16xHHHH2xL")
_LOCAL_COLS = np.array([0, 1, 2, 3, 26, 27, 28, 29])  # local header: signature, lengths
_TEMPLATES_PER_GROUP = 4
_CONSTANT = 64  # records up to this size that are the same in every item get one CRC


class _Template:
    """A central directory layout: entry offsets, names, what stays the same across items."""

    def __init__(self, cd: bytes, count: int):
        at, names, pos = [], [], 0
        for _ in range(count):
            if pos + 46 > len(cd):
                raise NotSimple("central directory runs past the archive")
            sig, flags, method, nlen, elen, clen, disk, external = _ENTRY.unpack_from(cd, pos)
            name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", "replace")
            if sig != b"PK\x01\x02" or method != 0 or entry_flags_problem(
                    name, flags, method, disk, 0, external) is not None:
                raise NotSimple("not a plain stored entry")  # the per-item path decides
            at.append(pos)
            names.append(name)
            pos += 46 + nlen + elen + clen
        if pos != len(cd) or not names or "/" not in names[0] or any(
                not n.startswith(names[0].split("/", 1)[0] + "/") for n in names):
            raise NotSimple("not the plain torch.save layout")  # the per-item path decides
        self.at = np.array(at, dtype=np.int64)
        self.ref = np.frombuffer(cd, np.uint8)
        self.keep = np.ones(len(cd), bool)
        for p in at:
            self.keep[p + 16:p + 28] = False  # CRC, compressed and uncompressed sizes
            self.keep[p + 42:p + 46] = False  # local header offset
        self.by_name = {n: k for k, n in enumerate(names)}  # the last of a name, as raw_item
        pkls = sorted((n for n in names if n.endswith("data.pkl")), key=len)
        self.pkl = self.by_name[pkls[0]] if pkls else None
        self.prefix = pkls[0][:-len("data.pkl")] if pkls else ""
        self.order = self.by_name.get(self.prefix + "byteorder")
        self.version = self.by_name.get(self.prefix + ".data/version",
                                        self.by_name.get(self.prefix + "version"))
        self.storage: dict[str, int | None] = {}

    def record(self, key: str) -> int | None:
        """The entry holding storage ``key``."""
        if key not in self.storage:
            self.storage[key] = self.by_name.get(f"{self.prefix}data/{key}")
        return self.storage[key]


def _tensor_info(pkl: bytes, tpl: _Template) -> tuple | None:
    """``(entry, nbytes, dtype, numel, lo, hi)`` of the tensor a ``data.pkl`` rebuilds: its
    storage record (``nbytes`` long), and the bytes ``[lo, hi)`` of it that the tensor covers
    exactly once -- when the per-item path (``torch_zip_read.raw_item``, ``dense_span``) would count
    it in place; else None."""
    try:
        dtype, shape, stride, offset, key, nbytes, _ = _describe(pkl)
    except NotSimple:
        return None
    k = tpl.record(key)
    itemsize = DTYPE_ITEMSIZE[dtype]
    if k is None or nbytes % itemsize or any(s < 0 for s in shape) \
            or any(st < 0 for st in stride):
        return None
    if math.prod(shape) and offset + sum((s - 1) * st for s, st in zip(shape, stride)) \
            >= nbytes // itemsize:
        return None
    span = RawItem(dtype, shape, tuple(stride), offset, memoryview(b""), None).dense_span()
    if span is None:
        return None
    return k, nbytes, dtype, math.prod(shape), span[0] * itemsize, span[1] * itemsize


def _end_records(arr: np.ndarray, off: np.ndarray, length: np.ndarray,
                 ok: np.ndarray) -> np.ndarray:
    """Each item's end-of-central-directory record; ``ok`` cleared where it is not plain."""
    ok &= length >= 22
    e = byte_rows(arr, np.where(ok, off + length - 22, off), 22).view(_EOCD)[:, 0]
    count, cd_size, cd_off = (e[k].astype(np.int64) for k in ("count", "cd_size", "cd_off"))
    ok &= (e["sig"] == 0x06054B50) & (e["disk"] == 0) & (e["cd_disk"] == 0) \
        & (e["n_disk"] == e["count"]) & (e["clen"] == 0) & (count > 0) & (count != 0xFFFF) \
        & (cd_size != _MAX32) & (cd_off != _MAX32) & (cd_off + cd_size <= length)
    # torch.save archives end with ZIP64 records, which PyTorch's reader uses instead of the
    # 32-bit ones: they must say the same, else the per-item path gives the verdict
    tail = 22 + 20 + 56
    has64 = ok & (length >= tail)
    at = np.where(has64, off + length - tail, off)
    z = byte_rows(arr, at, 56).view(_EOCD64)[:, 0]
    loc = byte_rows(arr, at + 56, 20).view(_LOC64)[:, 0]
    has64 &= loc["sig"] == 0x07064B50
    same = (z["sig"] == 0x06064B50) & (loc["off"].astype(np.int64) == length - tail) \
        & (loc["disks"] == 1) & (z["disk"] == 0) \
        & (z["cd_disk"] == 0) & (z["n_disk"].astype(np.int64) == count) \
        & (z["count"].astype(np.int64) == count) & (z["cd_size"].astype(np.int64) == cd_size) \
        & (z["cd_off"].astype(np.int64) == cd_off)
    ok &= ~has64 | same
    return np.stack([count, cd_size, cd_off])


def _match(cd: np.ndarray, count: int) -> list[tuple[_Template, np.ndarray]]:
    """Rows of ``cd`` (central directories of ``count`` entries, one per item) by template;
    rows matching none are left out."""
    out = []
    left = np.arange(len(cd))
    for _ in range(_TEMPLATES_PER_GROUP):
        if len(left) == 0:
            break
        try:
            tpl = _Template(cd[left[0]].tobytes(), count)
        except (NotSimple, struct.error):
            left = left[1:]
            continue
        same = ~((cd[left] != tpl.ref) & tpl.keep).any(axis=1)
        out.append((tpl, left[same]))
        left = left[~same]
    return out


def scan_items(buf: Any, off: np.ndarray, length: np.ndarray, count: np.ndarray,
               numel: np.ndarray, *, small: int, slab: int, dtype: np.ndarray | None = None,
               dtypes: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check the ``torch.save`` items at ``[off, off+length)`` of ``buf`` (a read-only mmap of
    one or many files; items in bounds, in order) and, where ``count``, count NaN/Inf of the
    tensor (``numel`` elements). ``dtype``: where >= 0, the item is a tensor chunk that must
    hold ``numel`` elements of ``dtypes[dtype]`` (what the metadata says; its ``data.pkl``
    is the truth).

    Returns ``(done, nan, inf)``: ``done[i]``, the item is intact (every record's CRC32 right,
    its tensor what the metadata says) and, if it was to be counted, its tensor was counted in
    place; the others are left to the per-item path. Tensors of at most ``small`` bytes are
    counted in batches, bigger ones in slabs of ``slab`` bytes."""
    if dtype is None:
        dtype = np.where(count, 0, -1)
        dtypes = ("",)  # (no dtype to compare: any)
    arr = np.frombuffer(buf, np.uint8)
    mv = memoryview(buf)
    n = len(off)
    ok = np.ones(n, bool)
    done = np.zeros(n, bool)
    nan = np.zeros(n, np.int64)
    inf = np.zeros(n, np.int64)
    try:
        entries, cd_size, cd_off = _end_records(arr, off, length, ok)
        key = entries * (1 << 32) + cd_size
        for k in np.unique(key[ok]).tolist():
            rows = np.flatnonzero(ok & (key == k))
            c, size = divmod(k, 1 << 32)
            cd = byte_rows(arr, off[rows] + cd_off[rows], size)
            for tpl, sub in _match(cd, c):
                g = _Group(tpl, rows[sub], cd[sub], off, length)
                g.locate(arr)
                g.dedupe(arr)
                g.check(arr, mv, count, numel, (dtype, dtypes), nan, inf, small, slab)
                done[g.rows[g.ok]] = True
    finally:
        del arr
        mv.release()
    return done, nan, inf


class _Group:
    """Items of one central directory template: ``crc``, ``size`` and ``start`` (in the
    buffer) of every record, one row per item; ``ok`` cleared for items left to the per-item
    path; ``plain``, the records still to be CRC'd one by one."""

    def __init__(self, tpl: _Template, rows: np.ndarray, cd: np.ndarray, off: np.ndarray,
                 length: np.ndarray):
        self.tpl, self.rows, self.off = tpl, rows, off[rows]
        n, c = len(rows), len(tpl.at)
        fields = np.ascontiguousarray(cd[:, (tpl.at[:, None] + np.arange(16, 28)).ravel()])
        crc, csize, usize = fields.view("<u4").reshape(n, c, 3).transpose(2, 0, 1)
        lho = np.ascontiguousarray(cd[:, (tpl.at[:, None] + np.arange(42, 46)).ravel()])
        self.lho = lho.view("<u4").astype(np.int64)
        self.crc, self.size = crc, usize.astype(np.int64)
        self.length = length[rows][:, None]
        self.ok = ((crc != _MAX32) & (csize == usize) & (usize != _MAX32)
                   & (self.lho != _MAX32) & (self.lho + 30 <= self.length)).all(axis=1)
        self.plain = np.ones((n, c), bool)

    def locate(self, arr: np.ndarray) -> None:
        """Where each record's data starts, from its local header."""
        n, c = self.lho.shape
        lho = np.where(self.ok[:, None], self.lho, 0)
        loc = arr.take((self.off[:, None] + lho).reshape(-1, 1) + _LOCAL_COLS, mode="clip")
        sig = loc[:, :4].copy().view("<u4")[:, 0].reshape(n, c)
        lens = loc[:, 4:].copy().view("<u2").astype(np.int64).reshape(n, c, 2)
        start = lho + 30 + lens[..., 0] + lens[..., 1]
        self.ok &= ((sig == 0x04034B50) & (start + self.size <= self.length)).all(axis=1)
        self.start = np.where(self.ok[:, None], start, 0) + self.off[:, None]

    def dedupe(self, arr: np.ndarray) -> None:
        """Records of at most ``_CONSTANT`` bytes with the same size and CRC in every item
        (format version, byte order, ...): compared byte for byte with the first item's, which
        gets the only CRC. ``order_ok``: items whose byte order is known to be little. Items
        whose archive version is not such a record, one PyTorch reads, are left to the
        per-item path."""
        self.order_ok = None
        first = np.flatnonzero(self.ok)
        versioned = np.zeros_like(self.ok)
        if len(first) == 0:
            return
        r, size, crc = first[0], self.size[first], self.crc[first]
        ks = [k for k in range(len(self.tpl.at)) if size[0, k] <= _CONSTANT
              and (size[:, k] == size[0, k]).all() and (crc[:, k] == crc[0, k]).all()]
        if not ks:
            self.ok &= versioned
            return
        sizes = self.size[r, ks]
        cols = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        pos = np.repeat(self.start[:, ks], sizes, axis=1) + cols  # every byte of those records
        data = arr.take(pos, mode="clip")
        same = data == data[r]
        at = 0
        for k, z in zip(ks, sizes.tolist()):
            ref = data[r, at:at + z].tobytes()
            if crc32(ref) == self.crc[r, k]:
                alike = same[:, at:at + z].all(axis=1) & self.ok
                self.plain[alike, k] = False
                if k == self.tpl.order and ref.strip() == b"little":
                    self.order_ok = alike
                if k == self.tpl.version and version_problem(ref) is None:
                    versioned = alike
            at += z
        self.ok &= versioned  # the others: the per-item path reads their version (P4)

    def check(self, arr: np.ndarray, mv: memoryview, count: np.ndarray, numel: np.ndarray,
              expect: tuple[np.ndarray, tuple[str, ...]], nan: np.ndarray, inf: np.ndarray,
              small: int, slab: int) -> None:
        """CRC every record; compare each tensor item with what the metadata says of it
        (``expect``: dtype ids, names); count the tensors of the items to count."""
        tpl, ok = self.tpl, self.ok
        tensor = expect[0][self.rows] >= 0
        want = tensor & ok
        if want.any() and tpl.pkl is None:
            want[:] = False
            ok[tensor] = False
        counted = want & count[self.rows]
        if counted.any() and tpl.order is not None:  # a byte order: little, or item by item
            known = self.order_ok if self.order_ok is not None else np.zeros_like(ok)
            ok[counted & ~known] = False
            want &= known | ~counted
        if want.any():
            self._count(arr, mv, want, count[self.rows], numel, expect, nan, inf, small, slab)
        i, k = np.nonzero(self.plain & ok[:, None])
        start = self.start[i, k]
        ok[i[crc_records(mv, start.tolist(), (start + self.size[i, k]).tolist(),
                         self.crc[i, k].tolist())]] = False

    def _count(self, arr: np.ndarray, mv: memoryview, want: np.ndarray, count: np.ndarray,
               numel: np.ndarray, expect: tuple[np.ndarray, tuple[str, ...]], nan: np.ndarray,
               inf: np.ndarray, small: int, slab: int) -> None:
        """Describe the tensors of the items ``want`` and, where ``count``, CRC and count them:
        each tensor's data are bytes ``[lo, hi)`` of its storage record (entry ``k``),
        described by its ``data.pkl``, which is checked here once per distinct content (and
        against the metadata: ``numel`` elements of dtype ``expect``). Items whose tensor is
        not what the metadata says, or cannot be counted in place, are left to the per-item
        path."""
        tpl, kp = self.tpl, self.tpl.pkl
        w = np.flatnonzero(want)
        ids, infos = describe_all(arr, self.start[w, kp], self.size[w, kp], self.crc[w, kp],
                                  lambda raw: _tensor_info(raw, tpl))
        dtypes = sorted({x[1][2] for x in infos if x[1] is not None})
        table = np.array([(c, *x[:2], x[3], x[4], x[5], dtypes.index(x[2])) if x is not None
                          else (-1, -1, -1, -1, 0, 0, 0) for c, x in infos], dtype=np.int64)
        crc, k, nbytes, n, lo, hi, dt = table[ids].T
        names = expect[1]
        as_expected = np.array([names.index(d) if d in names else -2 for d in dtypes]
                               + [-2], dtype=np.int64)  # (the last: no dtype)
        same = (as_expected[np.where(k >= 0, dt, -1)] == expect[0][self.rows[w]]) \
            | (names == ("",))
        good = (k >= 0) & (crc == self.crc[w, kp]) & (self.size[w, k] == nbytes) \
            & (numel[self.rows[w]] == n) & same
        self.ok[w[~good]] = False
        w, k, nbytes, lo, hi, dt = w[good], k[good], nbytes[good], lo[good], hi[good], dt[good]
        self.plain[w, kp] = False
        keep = count[w]  # the others are only checked: their records CRC'd with the rest
        w, k, nbytes, lo, hi, dt = w[keep], k[keep], nbytes[keep], lo[keep], hi[keep], dt[keep]
        start, crc, rows = self.start[w, k], self.crc[w, k], self.rows[w]
        for d, dtype in enumerate(dtypes):
            if dtype not in _BITS:
                continue  # nothing to count: the record is CRC'd with the others
            sel = np.flatnonzero((dt == d) & (hi > lo))
            self.plain[w[sel], k[sel]] = False
            big = hi[sel] - lo[sel] > small
            for j in sel[big].tolist():  # CRC and count slab by slab
                with mv[start[j]:start[j] + nbytes[j]] as rec:
                    got, nan_inf = big_tensor(rec, int(lo[j]), int(hi[j]), dtype, slab)
                if got != crc[j] or nan_inf is None:
                    self.ok[w[j]] = False
                else:
                    nan[rows[j]], inf[rows[j]] = nan_inf
            sel = sel[~big]
            bad = crc_and_pool(mv, start[sel], nbytes[sel], crc[sel], start[sel] + lo[sel],
                               hi[sel] - lo[sel], rows[sel], dtype, nan, inf)
            self.ok[w[sel[bad]]] = False
