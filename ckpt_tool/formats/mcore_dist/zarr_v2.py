"""Uncompressed zarr format v2 arrays on a filesystem, written without zarr-python.

Megatron-Core <= 0.15 wrote its ``zarr`` checkpoints through zarr-python 2. zarr-python 3 still
writes format v2 but not the same bytes (another header encoding, a ``.zattrs`` per array) and
has no process synchronizer, so ckpt_tool writes the v2 format itself: the same bytes whichever
zarr-python is installed, or none. What zarr-python 2 wrote for Megatron-Core's arrays
(docs/formats.md section 2):

* ``<array>/.zarray``: the JSON header, keys sorted, 4-space indent, ASCII, no final newline;
  ``compressor``, ``filters`` and ``fill_value`` null, order ``"C"``, ``zarr_format`` 2.
* one chunk file per chunk, named by its grid index joined with ``.`` (``"0"`` for 0-d arrays):
  the raw C-order bytes of the full chunk shape in the header's byte order; an edge chunk is
  padded to the full shape (zeros where nothing was written: ``fill_value`` null). Files are
  written beside their target and renamed into place.
* a write that covers only part of a chunk reads the chunk file (zeros if absent), updates it
  and writes it back; with :class:`ChunkLocks` (lock files ``<key>.sync/<chunk>``, and
  ``<key>.sync/.zarray`` taken around header accesses, as zarr's ProcessSynchronizer left them)
  several processes can write parts of one chunk.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np

from ckpt_tool.errors import CheckpointingException

__all__ = ["encode_header", "ChunkLocks", "V2Array"]

ZARRAY = ".zarray"


def encode_header(shape: Sequence[int], chunks: Sequence[int], dtype: str) -> bytes:
    """The ``.zarray`` bytes zarr-python 2 wrote for an uncompressed array, ``fill_value`` null."""
    meta = {"chunks": [int(c) for c in chunks], "compressor": None, "dtype": dtype,
            "fill_value": None, "filters": None, "order": "C",
            "shape": [int(s) for s in shape], "zarr_format": 2}
    return json.dumps(meta, indent=4, sort_keys=True, ensure_ascii=True,
                      separators=(",", ": ")).encode("ascii")


def _write_atomic(path: Path, data: Any) -> None:
    """Write ``data`` (bytes or a C-contiguous array) to ``path`` through a renamed temporary."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class ChunkLocks:
    """Inter-process locks per chunk: one lock file per chunk key in ``directory`` (POSIX
    ``lockf``, what zarr-python 2's ProcessSynchronizer took through ``fasteners``)."""

    def __init__(self, directory: os.PathLike | str):
        self.directory = Path(directory)

    @contextlib.contextmanager
    def __call__(self, chunk_key: str) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            raise CheckpointingException(
                "writing parts of one zarr chunk from several processes needs POSIX file locks"
            ) from None
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / chunk_key, "a") as f:
            fcntl.lockf(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(f, fcntl.LOCK_UN)


def _locked(locks: Optional[ChunkLocks], key: str) -> Any:
    """The lock of ``key`` (zarr-python 2 locked ``.zarray`` too, around each header access)."""
    return locks(key) if locks is not None else contextlib.nullcontext()


class V2Array:
    """An uncompressed zarr v2 array directory opened for writing; see the module docstring.

    ``dtype`` is the numpy dtype of the stored values (its byte order is the file's);
    ``locks`` (a :class:`ChunkLocks`) is taken around every chunk write when given.
    """

    def __init__(self, path: os.PathLike | str, shape: Sequence[int], chunks: Sequence[int],
                 dtype: np.dtype, locks: Optional[ChunkLocks] = None):
        self.path = Path(path)
        self.shape = tuple(int(s) for s in shape)
        self.chunks = tuple(int(c) for c in chunks)
        self.dtype = np.dtype(dtype)
        self.locks = locks
        if len(self.chunks) != len(self.shape) or any(c <= 0 for c in self.chunks):
            raise CheckpointingException(
                f"zarr array {self.path}: chunks {list(self.chunks)} do not fit shape "
                f"{list(self.shape)}")

    @classmethod
    def create(cls, path: os.PathLike | str, shape: Sequence[int], chunks: Sequence[int],
               dtype: np.dtype, dtype_name: str, locks: Optional[ChunkLocks] = None
               ) -> "V2Array":
        """Write the header of a new array (``dtype_name`` is its ``.zarray`` dtype string);
        CheckpointingException if ``path`` already holds an array."""
        arr = cls(path, shape, chunks, dtype, locks)
        arr.path.mkdir(parents=True, exist_ok=True)
        if (arr.path / ZARRAY).exists() or (arr.path / ".zgroup").exists():
            raise CheckpointingException(f"Array {arr.path} already exists")
        with _locked(locks, ZARRAY):
            _write_atomic(arr.path / ZARRAY, encode_header(arr.shape, arr.chunks, dtype_name))
        return arr

    @staticmethod
    def header(path: os.PathLike | str, locks: Optional[ChunkLocks] = None) -> Dict[str, Any]:
        """The parsed ``.zarray`` of ``path`` (read under the ``.zarray`` lock of ``locks``);
        CheckpointingException if this module cannot write the array (compressed, filtered,
        F order or another separator)."""
        zpath = Path(path) / ZARRAY
        try:
            with _locked(locks, ZARRAY):
                meta = json.loads(zpath.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointingException(f"Cannot read zarr array header {zpath}: {e}") from e
        if meta.get("compressor") is not None or meta.get("filters") or \
                meta.get("order", "C") != "C" or meta.get("dimension_separator", ".") != ".":
            raise CheckpointingException(
                f"zarr array {path} is compressed, filtered or not C-ordered: ckpt_tool only "
                "writes into uncompressed C-order arrays (what Megatron-Core created)")
        return meta

    # ------------------------------------------------------------------ writing

    def __setitem__(self, selection: Any, values: Any) -> None:
        """Write ``values`` to a region: a tuple of step-1 slices and integers per axis."""
        if not isinstance(selection, tuple):
            selection = (selection,)
        if len(selection) != len(self.shape):
            raise CheckpointingException(
                f"zarr array {self.path}: selection {selection} does not fit shape {self.shape}")
        bounds = []
        for sel, n in zip(selection, self.shape):
            if isinstance(sel, slice):
                start, stop, step = sel.indices(n)
                if step != 1:
                    raise CheckpointingException(f"zarr array {self.path}: step {step} "
                                                 "selections cannot be written")
            else:
                start = int(sel) + n if int(sel) < 0 else int(sel)
                stop = start + 1
                if not 0 <= start < n:
                    raise CheckpointingException(f"zarr array {self.path}: index {sel} out of "
                                                 f"range for an axis of {n}")
            bounds.append((start, max(start, stop)))
        region = tuple(b - a for a, b in bounds)
        values = np.asarray(values)
        values = values.reshape(region) if values.size == math.prod(region) \
            else np.broadcast_to(values, region)
        ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(bounds, self.chunks)]
        for idx in itertools.product(*ranges):
            origin = [i * c for i, c in zip(idx, self.chunks)]
            lo = [max(a, o) for (a, _), o in zip(bounds, origin)]
            hi = [min(b, o + c) for (_, b), o, c in zip(bounds, origin, self.chunks)]
            src = tuple(slice(x - a, y - a) for x, y, (a, _) in zip(lo, hi, bounds))
            dst = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, origin))
            whole = all(y - x == c for x, y, c in zip(lo, hi, self.chunks))
            self._update_chunk(idx, dst, values[src], whole)

    def set_coordinate_selection(self, coordinates: Sequence[Any], values: Any) -> None:
        """Write ``values[i]`` at the point ``(coordinates[0][i], coordinates[1][i], ...)``
        (flattened tensors: each process writes its range of a chunk)."""
        coords = [np.asarray(c, dtype=np.int64).reshape(-1) for c in coordinates]
        values = np.asarray(values).reshape(-1)
        if len(coords) != len(self.shape) or any(len(c) != len(values) for c in coords):
            raise CheckpointingException(
                f"zarr array {self.path}: {len(values)} values do not fit the coordinates")
        if not len(values):
            return
        for c, n in zip(coords, self.shape):
            if c.min() < 0 or c.max() >= n:
                raise CheckpointingException(f"zarr array {self.path}: coordinate out of range")
        grid = [-(-n // c) for n, c in zip(self.shape, self.chunks)]
        chunk_of = [c // k for c, k in zip(coords, self.chunks)]
        ids = np.ravel_multi_index(chunk_of, grid) if grid else np.zeros(len(values), np.int64)
        order = np.argsort(ids, kind="stable")
        starts = np.flatnonzero(np.r_[True, ids[order][1:] != ids[order][:-1]])
        for begin, end in zip(starts, list(starts[1:]) + [len(order)]):
            pick = order[begin:end]
            idx = tuple(int(ch[pick[0]]) for ch in chunk_of)
            local = tuple(c[pick] - i * k for c, i, k in zip(coords, idx, self.chunks))
            self._update_chunk(idx, local, values[pick], False)

    def _update_chunk(self, idx: Tuple[int, ...], where: Any, values: np.ndarray,
                      whole: bool) -> None:
        key = ".".join(map(str, idx)) if idx else "0"
        with _locked(self.locks, key):
            if whole:
                chunk = np.ascontiguousarray(values, dtype=self.dtype)
            else:
                chunk = self._read_chunk(key)
                chunk[where] = values
            _write_atomic(self.path / key, chunk)

    def _read_chunk(self, key: str) -> np.ndarray:
        path = self.path / key
        expected = math.prod(self.chunks) * self.dtype.itemsize
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return np.zeros(self.chunks, dtype=self.dtype)
        except OSError as e:
            raise CheckpointingException(f"Cannot read zarr chunk {path}: {e}") from e
        if len(data) != expected:
            raise CheckpointingException(
                f"zarr chunk {path} has {len(data)} bytes, expected {expected}: not an "
                "uncompressed chunk of this array")
        return np.frombuffer(bytearray(data), dtype=self.dtype).reshape(self.chunks)
