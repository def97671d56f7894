"""Writer for safetensors (HF layout), plus the slab planning all file writers share.

Output: ``model.safetensors`` when everything fits in one shard, else
``model-0000i-of-0000N.safetensors`` shards of at most ``max_shard_size`` bytes (a tensor larger
than the limit gets a shard of its own, as huggingface_hub's splitter does) and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {...}}``).
``WriterOptions.file_name`` (e.g. ``"weights.safetensors"``) changes the ``model`` stem.
Optimizer state (``model.is_optimizer_key``: ``optimizer.*``, DCP ``optim.*``, ...) never goes
into the model's files, which HF loaders read as the weights: it is written beside them, in
``optimizer.safetensors`` (or ``optimizer-0000i-of-0000N.safetensors`` +
``optimizer.safetensors.index.json``), with the same sharding rule.

Each file is written as the real library does: 8-byte little-endian header length, compact
JSON header (``__metadata__`` first, then tensors in data order) padded with spaces to a
multiple of 8, raw C-order little-endian data. Inside a file tensors are ordered by item size,
largest first (stable), so every tensor starts aligned to its item size. The header is known
from the metadata alone, so it is written first and the data streamed after it, slab by slab
(:func:`slab_pieces`): peak memory is one slab (``max_memory``, default 256 MiB), or less when
the tensor's metadata lists the chunks its source stores (``convert`` keeps a plain tiling):
then slabs are no bigger than the largest of those (16 MiB at least), so a stacked tensor held
one layer per chunk is never gathered into slabs many layers big.

``__metadata__`` holds ``{"format": "pt"}``, the source description and the top-level scalar
common values (``iteration``, ``checkpoint_version``, ...) as strings. Everything else
(ShardedObjects, ``args`` and other non-scalar common values) is dropped with a note.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UnsupportedError, UsageError, plural
from ckpt_tool.formats.write_pieces import (
    DEFAULT_MAX_MEMORY,
    my_share,
    pull_piece,
    run_share,
    run_tasks,
    slab_pieces,
    tensor_bytes,
)
from ckpt_tool.formats.writer import WriteRequest, Writer, dropped_objects_note
from ckpt_tool.model import TensorMeta, dtype_itemsize, is_optimizer_key
from ckpt_tool.printable import is_printable, printable
from ckpt_tool.writeback import start_writeback

__all__ = ["scalar_common", "SAFETENSORS_CODES", "plan_shards", "SafetensorsWriter",
           "OPTIMIZER_STEM"]

#: the optimizer state goes beside the model's weights, in ``optimizer*.safetensors``
OPTIMIZER_STEM = "optimizer"

_MIN_PIECE = 16 << 20  # smaller pieces only cost calls
_WRITEBACK_FROM = 1 << 20  # slabs this big have their write-back started at once

#: torch dtype name -> safetensors dtype code, for the dtypes safetensors.torch can load.
SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}


def scalar_common(common: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``(kept, dropped)``: top-level common values that are plain scalars (numpy scalars
    unwrapped), and the names of everything else."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    for k, v in common.items():
        if hasattr(v, "item") and getattr(v, "shape", None) == () and \
                type(v).__module__.startswith("numpy"):
            v = v.item()
        if isinstance(v, (bool, int, float, str)) or v is None:
            kept[str(k)] = v
        else:
            dropped.append(str(k))
    return kept, dropped


def plan_shards(tensors: list[TensorMeta], max_shard_size: int) -> list[list[TensorMeta]]:
    """Split in order into shards of at most ``max_shard_size`` bytes (huggingface_hub's rule:
    a tensor larger than the limit gets a shard of its own)."""
    shards: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_shard_size:
            shards.append([t])
            continue
        if current and size + t.nbytes > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not shards:
        shards.append(current)
    return shards


class SafetensorsWriter(Writer):
    """HF-style safetensors writer; see the module docstring. Under torchrun every rank
    writes whole shard files (split by bytes) and rank 0 the index."""

    format_name = "safetensors"
    supports_ranks = True
    file_suffixes = (".safetensors",)
    keeps_common = "scalars"  # (in __metadata__)
    keeps_source_grid = True  # (each tensor pulled piece by piece along it)
    takes_raw_bytes = shards_by_size = optimizer_beside = True

    def write(self, request: WriteRequest) -> list[str]:
        """Write the shards (and the index when more than one); return what was dropped."""
        self.objects_written = 0  # the format holds tensors only
        tensors = list(request.meta.tensors.values())
        for t in tensors:
            if t.key == "__metadata__":
                raise UnsupportedError("a tensor named '__metadata__' cannot be stored in "
                                       "safetensors (the name is reserved)", hint="rename it")
            if t.dtype not in SAFETENSORS_CODES:
                raise UnsupportedError(
                    f"tensor {t.key!r}: dtype {t.dtype} cannot be stored in safetensors",
                    hint="cast it (supported: " + ", ".join(SAFETENSORS_CODES) + ")")
        if self.options.max_shard_size <= 0:
            raise UsageError(f"max shard size {self.options.max_shard_size} must be > 0")
        notes, metadata = self._metadata(request)
        stem = Path(self.options.file_name or "model.safetensors").name
        stem = stem[: -len(".safetensors")] if stem.endswith(".safetensors") else stem
        # the model's weights in model*.safetensors (what HF loaders read), the optimizer
        # state beside them in optimizer*.safetensors
        optim = [t for t in tensors if is_optimizer_key(t.key)]
        model = [t for t in tensors if not is_optimizer_key(t.key)]
        groups = [(stem, model)] if model or not optim else []
        if optim:
            groups.append((OPTIMIZER_STEM, optim))
        files: list[tuple[str, list[TensorMeta]]] = []
        indexes: list[tuple[str, list[tuple[str, list[TensorMeta]]]]] = []
        for group_stem, group in groups:
            shards = plan_shards(group, self.options.max_shard_size)
            n = len(shards)
            named = [(f"{group_stem}.safetensors" if n == 1 else
                      f"{group_stem}-{i + 1:05d}-of-{n:05d}.safetensors", shard)
                     for i, shard in enumerate(shards)]
            files += named
            if n > 1:
                indexes.append((group_stem, named))
        budget = self.options.max_memory or DEFAULT_MAX_MEMORY
        ranks = request.ranks
        mine = my_share(ranks, [sum(t.nbytes for t in shard) for _, shard in files])

        threads = max(1, int(self.options.extra.get("threads", 1)))

        def work() -> None:
            tasks = []
            fds = []
            try:
                for i in mine:  # headers first: every tensor's place is then known
                    name, shard = files[i]
                    fd, placed = self._start_file(self.directory / name, shard, metadata)
                    fds.append(fd)
                    tasks += [(fd, at, t, piece) for at, t in placed
                              for at, piece in _slabs(at, t, _piece_budget(t, budget))]
                if threads > 1:  # biggest first: the threads end together
                    tasks.sort(key=lambda task: -math.prod(task[3][1])
                               * dtype_itemsize(task[2].dtype))
                lock = threading.Lock()

                def progress(nbytes: int) -> None:
                    with lock:
                        request.progress(nbytes)

                run_tasks(tasks, lambda task: self._write_slab(*task, request, progress),
                          threads)
            finally:
                for fd in fds:
                    os.close(fd)
            if ranks is not None and not ranks.is_main:
                return
            for group_stem, named in indexes:
                index = {"metadata": {"total_size": sum(t.nbytes for _, sh in named
                                                        for t in sh)},
                         "weight_map": {t.key: name for name, sh in named for t in sh}}
                if request.source_description:
                    index["metadata"]["source"] = printable(request.source_description)
                (self.directory / f"{group_stem}.safetensors.index.json").write_text(
                    json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

        run_share(ranks, work)
        return notes

    @staticmethod
    def _metadata(request: WriteRequest) -> tuple[list[str], dict[str, str]]:
        notes: list[str] = []
        metadata = {"format": "pt"}
        if request.source_description:  # (a path: its name may not be UTF-8)
            metadata["source"] = printable(request.source_description)
        kept, dropped = scalar_common(request.common)
        for k, v in kept.items():
            metadata.setdefault(printable(k), json.dumps(v) if not isinstance(v, str)
                                else printable(v))
        if dropped:
            notes.append(f"dropped {plural(len(dropped), 'common value')} "
                         f"({', '.join(sorted(dropped))}):"
                         " safetensors __metadata__ holds strings only"
                         + (f"; kept {', '.join(sorted(kept))} as strings" if kept else ""))
        notes += dropped_objects_note(request, "safetensors holds tensors only")
        return notes, metadata

    @staticmethod
    def _start_file(path: Path, shard: list[TensorMeta], metadata: dict[str, str]
                    ) -> tuple[int, list[tuple[int, TensorMeta]]]:
        """Create ``path`` with its header; return its descriptor and where each tensor's
        data goes (file offsets)."""
        ordered = sorted(shard, key=lambda t: -dtype_itemsize(t.dtype))  # stable
        header: dict[str, Any] = {"__metadata__": metadata}
        pos = 0
        for t in ordered:
            header[t.key] = {"dtype": SAFETENSORS_CODES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        try:
            raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            bad = next(t.key for t in ordered if not is_printable(t.key))
            raise UnsupportedError(f"tensor key {printable(bad)!r} is not valid Unicode: a "
                                   "safetensors header is UTF-8 JSON",
                                   hint="rename it (--rename) or convert to another format") \
                from None
        raw += b" " * (-len(raw) % 8)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            _pwrite_all(fd, struct.pack("<Q", len(raw)) + raw, 0)
        except BaseException:
            os.close(fd)
            raise
        placed, at = [], 8 + len(raw)
        for t in ordered:
            placed.append((at, t))
            at += t.nbytes
        return fd, placed

    @staticmethod
    def _write_slab(fd: int, at: int, t: TensorMeta, piece: tuple, request: WriteRequest,
                    progress: Any) -> None:
        data = pull_piece(request, t, *piece)
        view = tensor_bytes(data)
        _pwrite_all(fd, view, at)
        if view.nbytes >= _WRITEBACK_FROM:  # to disk now, not all at the final fsync
            start_writeback(fd, at, view.nbytes)
        del data
        progress(view.nbytes)


def _piece_budget(t: TensorMeta, budget: int) -> int:
    """The most bytes of ``t`` pulled at once: ``budget``, or the largest of the chunks its
    metadata lists when there are several (at least ``_MIN_PIECE``; see the module doc)."""
    if len(t.chunks) <= 1:
        return budget
    largest = max(c.numel for c in t.chunks) * dtype_itemsize(t.dtype)
    return min(budget, max(largest, _MIN_PIECE))


def _slabs(at: int, t: TensorMeta, budget: int) -> list[tuple[int, tuple]]:
    """``(file offset, (offsets, sizes))`` of the slabs a tensor stored at ``at`` is written
    in (C order: each slab continues where the last ended)."""
    if t.numel == 0:
        return []
    out = []
    for offsets, sizes in slab_pieces(t.shape, dtype_itemsize(t.dtype), budget):
        out.append((at, (offsets, sizes)))
        at += math.prod(sizes) * dtype_itemsize(t.dtype)
    return out


def _pwrite_all(fd: int, data: Any, at: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
