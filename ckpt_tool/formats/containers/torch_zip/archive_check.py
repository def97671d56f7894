"""Bytes of a ``torch.save`` archive checked against what the archive records, before use.

``torch.load`` ignores the CRC-32 of zip records, so a flipped bit in a tensor loads silently;
a tool that copies what it read into a new checkpoint (with fresh, valid CRCs) would pass the
damage on as good data. Every read of ``ckpt_tool`` that moves archive bytes on -- a DCP item
of a ``.distcp`` file, a Megatron-LM legacy rank file, a ``torch.save`` file, ``common.pt``,
an object's bytes item -- goes through here first:

* :func:`check_archive` parses the archive as PyTorch's reader does (``zip_directory``) and
  checks the CRC-32 of every record (ISA-L's when installed): a mismatch raises
  :class:`IntegrityError` (exit 1) naming the record, an archive no loader reads
  ``CorruptCheckpointError`` (exit 2); archives the fast parser does not follow get
  ``zipfile``'s verdict (:func:`check_zip_item`, which checks the CRCs as it decompresses);
* :func:`check_item` (bytes in hand, or the mapping the caller then copies from: one pass of
  page faults) and :func:`check_range` / :func:`check_file` (a mapping of their own, released
  slab by slab: memory stays small whatever the size) do that once per item of a file: a
  verdict is kept by the file's identity (device, inode, size, mtime) and byte range, so the
  second read of an item (another slice of the same chunk) costs nothing, and threads reading
  one item at once wait for one check; an object of an object store (``ckpt_tool.storage``)
  gets the same checks over the bytes fetched (:func:`check_fetched`), its identity its URL,
  size and modification time;
* :func:`torch_reader_problem` asks PyTorch's own archive reader (``PyTorchFileReader``, no
  unpickling) for its verdict: ``validate --deep`` runs it besides the fast checks.

The check always comes before the bytes are used: nothing unchecked reaches a writer or a
comparison.
"""

from __future__ import annotations

import io
import mmap
import os
import re
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

from ckpt_tool._crc import crc32
from ckpt_tool.errors import CorruptCheckpointError, IntegrityError
from ckpt_tool.formats.containers.torch_zip.zip_directory import (NotSimple, TorchRejects,
                                                                  ZipRecord, zip_records)
from ckpt_tool.storage import as_path, file_size, is_remote

__all__ = ["check_archive", "check_item", "check_fetched", "check_range", "check_file",
           "check_many", "torch_reader_problem", "check_zip_item", "BoundedReader", "HINT"]

HINT = ("the source is damaged: restore it from a good copy; 'ckpt validate --deep' lists "
        "every damaged item")
_SLAB = 64 << 20  # CRC'd, then released from the mapping, a slab at a time
_ZIP_BLOCK = 1 << 20  # what zipfile reads at a time (check_zip_item)
_RELEASE_MIN = 1 << 20  # slabs at least this big have their pages released once CRC'd
_SMALL_RECORD = 1 << 20  # torch_reader_problem extracts records up to this size
_KEEP = 1 << 16  # verdicts remembered
_THREADS = 4
_lock = threading.Lock()
_checked: OrderedDict[tuple, None] = OrderedDict()  # items known good, by identity
_busy: dict[tuple, threading.Event] = {}  # items being checked by some thread


def _crc_of(buf: Any, start: int, size: int, release: Any = None) -> int:
    """CRC-32 of ``buf[start:start + size]``, slab by slab; ``release(lo, hi)`` is told each
    slab done (to drop its pages from a mapping)."""
    crc = 0
    with memoryview(buf) as view:
        for at in range(start, start + size, _SLAB):
            end = min(at + _SLAB, start + size)
            with view[at:end] as part:
                crc = crc32(part, crc)
            if release is not None:
                release(at, end)
    return crc & 0xFFFFFFFF


def _zipfile_verdict(buf: Any) -> str | None:
    """``zipfile``'s verdict on an archive the fast parser does not follow (it checks every
    record's CRC-32 as it reads it)."""
    data = io.BytesIO(bytes(buf))
    return check_zip_item(data, 0, len(data.getbuffer()))


def _unreadable(what: str, why: str, path: str | Path | None) -> CorruptCheckpointError:
    """The error for an archive no loader reads (exit 2, as any unreadable input); a CRC-32
    mismatch ``zipfile`` found is damage a loader would read: IntegrityError (exit 1)."""
    cls = IntegrityError if "CRC" in why else CorruptCheckpointError
    return cls(f"{what}: {why}", path=path, hint=HINT)


def check_archive(buf: Any, what: str, *, path: str | Path | None = None,
                  release: Any = None) -> list[ZipRecord] | None:
    """The records of the ``torch.save`` archive ``buf`` once every record's CRC-32 matched
    (None: an archive only ``zipfile`` follows, which found it intact); naming ``what`` (and
    ``path``), IntegrityError (exit 1) when a record's bytes do not match its CRC-32,
    CorruptCheckpointError (exit 2) when the archive cannot be read at all (what PyTorch's
    reader refuses, or not a zip archive)."""
    try:
        records = zip_records(buf)
    except TorchRejects as exc:
        raise _unreadable(what, f"damaged torch.save archive ({exc}; torch.load refuses it)",
                          path) from None
    except NotSimple:
        why = _zipfile_verdict(buf)
        if why is not None:
            raise _unreadable(what, why, path) from None
        return None
    if not all(r.stored for r in records):
        why = _zipfile_verdict(buf)
        if why is not None:
            raise _unreadable(what, why, path) from None
        return records
    for r in records:
        got = _crc_of(buf, r.start, r.size, release)
        if got != r.crc:
            raise IntegrityError(
                f"{what}: zip record {r.name!r} fails its CRC-32 check (computed {got:08x}, "
                f"recorded {r.crc:08x}): its bytes are damaged", path=path, hint=HINT)
    return records


def _identity(fd: int, offset: int, length: int) -> tuple:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, offset, length


def _claim(key: tuple) -> bool:
    """True when the caller is to check the item ``key`` (and then :func:`_settle` it);
    False when it is known good (after waiting for another thread checking it)."""
    while True:
        with _lock:
            if key in _checked:
                _checked.move_to_end(key)
                return False
            busy = _busy.get(key)
            if busy is None:
                _busy[key] = threading.Event()
                return True
        busy.wait()  # the other verdict: known good now, or the check is ours to repeat


def _settle(key: tuple, good: bool) -> None:
    with _lock:
        if good:
            _checked[key] = None
            while len(_checked) > _KEEP:
                _checked.popitem(last=False)
        _busy.pop(key).set()


def _once(key: tuple, check: Callable[[], Any]) -> Any:
    """``check()`` unless the item ``key`` is known good (then None); good once it returns."""
    if not _claim(key):
        return None
    good = False
    try:
        got = check()
        good = True
    finally:
        _settle(key, good)
    return got


def check_item(fd: int, offset: int, length: int, buf: Any, what: str, *,
               path: str | Path | None = None) -> list[ZipRecord] | None:
    """:func:`check_archive` of the item ``buf`` (bytes ``[offset, offset + length)`` of the
    open file ``fd``), unless that item of that file was checked already; its records when
    they were parsed here (for the caller's reader: not parsed twice), else None."""
    return _once(_identity(fd, offset, length),
                 lambda: check_archive(buf, what, path=path))


def check_fetched(path: Any, offset: int, length: int, buf: Any,
                  what: str) -> list[ZipRecord] | None:
    """:func:`check_item` of an item fetched from an object store (``ckpt_tool.storage``)
    into ``buf``: the same check, the object's identity its URL, size and modification
    time."""
    st = path.stat()
    return _once((str(path), st.st_size, st.st_mtime_ns, offset, length),
                 lambda: check_archive(buf, what, path=path))


def _check_object_range(path: Any, offset: int, length: int, what: str) -> None:
    """:func:`check_range` of an object-store item: fetched whole (parallel ranged GETs; the
    memory of one item, as the read that follows), then :func:`check_fetched`."""
    from ckpt_tool.storage import read_into

    if length <= 0:
        raise CorruptCheckpointError(f"{what}: no bytes, not a torch.save archive", path=path,
                                     hint=HINT)
    buf = bytearray(length)
    try:
        got = read_into(path, offset, buf)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what}: the object is missing", path=path) from None
    if got != length:
        raise CorruptCheckpointError(f"{what}: the object is truncated ({length} bytes "
                                     f"needed, {got} present)", path=path, hint=HINT)
    check_fetched(path, offset, length, buf, what)


def check_range(fd: int, offset: int, length: int, what: str, *,
                path: str | Path | None = None) -> None:
    """:func:`check_item` of bytes ``[offset, offset + length)`` of the open file ``fd``,
    read over a mapping whose pages are released slab by slab as their CRC is known (memory
    stays small whatever the size)."""
    if length <= 0:
        raise CorruptCheckpointError(f"{what}: no bytes, not a torch.save archive", path=path,
                                     hint=HINT)
    size = os.fstat(fd).st_size
    if offset < 0 or offset + length > size:
        raise CorruptCheckpointError(f"{what}: the file ends at byte {size}, before the item "
                                     "does (truncated, or its recorded place is damaged)",
                                     path=path, hint=HINT)

    def check() -> None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, offset + length - start, access=mmap.ACCESS_READ,
                       offset=start) as mapped:
            def release(lo: int, hi: int) -> None:  # bytes [lo, hi) of the item
                if hi - lo < _RELEASE_MIN:
                    return  # (small records: their pages are few, and shared)
                lo += offset - start
                lo -= lo % mmap.PAGESIZE
                try:
                    mapped.madvise(mmap.MADV_DONTNEED, lo, hi + offset - start - lo)
                except (AttributeError, OSError, ValueError):
                    pass

            with memoryview(mapped) as whole, whole[offset - start:] as item:
                check_archive(item, what, path=path, release=release)

    _once(_identity(fd, offset, length), check)


def check_file(path: str | Path, what: str = "torch.save file") -> None:
    """:func:`check_range` of the whole file ``path`` (a ``torch.save`` file), once per
    version of the file (an object of an object store: fetched whole, then checked)."""
    if is_remote(path):
        _check_object_range(as_path(path), 0, file_size(as_path(path)), what)
        return
    with open(path, "rb") as f:
        check_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, what, path=path)


def check_many(archives: Iterable[tuple[Path, int | None, int | None]]) -> None:
    """:func:`check_range` of each ``(file, offset, length)`` (offset None: the whole file,
    :func:`check_file`), a few at a time on threads (the CRC releases the GIL); the first
    damaged one raises."""
    todo = sorted(set(archives), key=lambda a: (str(a[0]), a[1] or 0))

    def one(a: tuple[Path, int | None, int | None]) -> None:
        path, offset, length = a
        if offset is None or length is None:
            check_file(path)
            return
        if is_remote(path):
            _check_object_range(as_path(path), offset, length,
                                f"item at bytes [{offset}, {offset + length})")
            return
        with open(path, "rb") as f:
            check_range(f.fileno(), offset, length,
                        f"item at bytes [{offset}, {offset + length})", path=path)

    if len(todo) <= 1:
        for a in todo:
            one(a)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(_THREADS, len(todo)), thread_name_prefix="ckpt-crc") as pool:
        for _ in pool.map(one, todo):
            pass


_MINIZ_TAIL = re.compile(r"\. This is an internal miniz error.*", re.S)


def torch_reader_problem(f: Any, offset: int, length: int) -> str | None:
    """PyTorch's own verdict on the archive at ``[offset, offset + length)`` of the open file
    ``f``: its reader (``torch._C.PyTorchFileReader``, what ``torch.load`` opens archives
    with; nothing is unpickled) lists the records and reads each one (records over 1 MiB:
    their place only). None when it accepts the archive, else its first line."""
    import torch

    if length <= _SMALL_RECORD:
        f.seek(offset)
        source: Any = io.BytesIO(f.read(length))
    else:
        source = BoundedReader(f, offset, length)
    try:
        reader = torch._C.PyTorchFileReader(source)
        for name in reader.get_all_records():
            if reader.get_record_size(name) <= _SMALL_RECORD:
                reader.get_record(name)
            else:
                reader.get_record_offset(name)
    except Exception as exc:  # noqa: BLE001 - whatever it raises is its verdict
        text = _MINIZ_TAIL.sub("", str(exc)).strip().splitlines()
        line = next((ln for ln in text if ln.strip()), type(exc).__name__)
        return re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", line)
    return None


class BoundedReader:
    """A read-only, seekable view of ``[offset, offset + length)`` of an open binary file,
    for ``zipfile`` to parse one DCP item in place (nothing is read into memory up front)."""

    def __init__(self, f: Any, offset: int, length: int):
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence == 1:
            pos += self._pos
        elif whence == 2:
            pos += self._len
        if pos < 0:
            raise OSError("negative seek position")
        self._pos = pos
        return pos

    def read(self, n: int = -1) -> bytes:
        left = max(0, self._len - self._pos)
        n = left if n is None or n < 0 else min(n, left)
        if n == 0:
            return b""
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        self._pos += len(data)
        return data

    def close(self) -> None:
        pass

    def flush(self) -> None:
        pass


def check_zip_item(f: Any, offset: int, length: int) -> str | None:
    """None if the torch.save archive at ``[offset, offset+length)`` of ``f`` is intact (every
    entry's CRC32 matches), else why not. Streams entries in 1 MiB blocks."""
    try:
        with zipfile.ZipFile(BoundedReader(f, offset, length)) as zf:
            infos = zf.infolist()
            if not infos:
                return "empty zip archive"
            for info in infos:
                with zf.open(info) as entry:
                    while entry.read(_ZIP_BLOCK):
                        pass
    except zipfile.BadZipFile as exc:
        return f"damaged torch.save archive ({exc})"
    except (OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
        return f"unreadable torch.save archive ({type(exc).__name__}: {exc})"
    except Exception as exc:  # zlib.error and friends
        return f"unreadable torch.save archive ({type(exc).__name__}: {exc})"
    return None
