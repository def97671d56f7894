"""Writer for one ``torch.save`` file that ``torch.load(weights_only=True, mmap=True)`` reads.

The file holds a flat ``{key: tensor}`` dict of full tensors (what ``load_state_dict`` and HF
conversion scripts expect). It is built with the same zip writer ``torch.save`` uses
(``torch._C.PyTorchFileWriter``: 64-byte aligned records, CRC32s) and the same records in the
same order: ``data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``,
``data/0``, ``data/1``, ... and, on close, ``version`` and ``.data/serialization_id``.
``data.pkl`` is pickled (protocol 2) from placeholders that reduce exactly as real tensors do
(``_rebuild_tensor_v2`` over a typed storage, ``_rebuild_tensor_v3`` for the new dtypes such
as float8), so it is byte-identical to ``torch.save`` of the same dict of contiguous tensors.

Streaming: ``data.pkl`` needs only shapes and dtypes, so it is written first; then each
tensor's storage is pulled and written as one record, one tensor at a time. The zip writer
cannot append to a record, so a tensor larger than ``max_memory`` only gets its record
reserved (``write_record_metadata``, what ``torch.serialization.skip_data`` uses); once the
archive is closed its data is streamed into place slab by slab and its CRC32 patched in the
local header and the central directory. Such files differ from ``torch.save``'s only in
``.data/serialization_id`` (an id derived from the CRCs at write time); files without
tensors over the budget are byte-identical.

Common state: dropped with a note by default. With ``WriterOptions.extra["torch_keep_common"]``
the top-level common values that ``weights_only`` can load (nested dicts/lists/tuples of
ints, floats, strings, bools, None) are stored beside the tensors; the rest (Megatron-LM's
``args`` Namespace, tensors inside the common state, ...) is still dropped with a note.
ShardedObjects are always dropped with a note. torch.save has no place for the source
description.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from ckpt_tool._crc import crc32
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UnsupportedError, plural
from ckpt_tool.formats.write_pieces import (DEFAULT_MAX_MEMORY, pull_piece, slab_pieces,
                                         tensor_bytes)
from ckpt_tool.formats.containers.torch_zip.torch_save_files import zip_data_offsets
from ckpt_tool.formats.write_guard import (finish_failed_writer, raise_write_failure, uninterrupted,
                                          zip_writer_name)
from ckpt_tool.formats.writer import WriteRequest, Writer, dropped_objects_note
from ckpt_tool.model import TensorMeta, dtype_itemsize

__all__ = ["TorchSaveWriter", "weights_only_safe"]

_PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL


class _StoragePlaceholder:
    """Pickled (through ``persistent_id``) as torch.save pickles a storage."""

    def __init__(self, key: str, storage_type: Any, numel: int):
        self.key, self.storage_type, self.numel = key, storage_type, numel


class _TensorPlaceholder:
    """Reduces as ``Tensor._reduce_ex_internal`` does for a contiguous CPU tensor."""

    def __init__(self, meta: TensorMeta, key: str):
        import torch

        dtype = getattr(torch, meta.dtype)
        self.shape = tuple(meta.shape)
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.insert(0, acc)
            acc *= s
        self.stride = tuple(stride)
        if dtype in torch.storage._new_dtypes():
            self.rebuild = torch._utils._rebuild_tensor_v3
            self.storage = _StoragePlaceholder(key, torch.UntypedStorage,
                                               meta.numel * dtype_itemsize(meta.dtype))
            self.extra: tuple = (dtype,)
        else:
            type_name = torch.storage._dtype_to_storage_type_map().get(dtype)
            if type_name is None:
                raise UnsupportedError(f"tensor {meta.key!r}: dtype {meta.dtype} cannot be "
                                       "saved with torch.save")
            self.rebuild = torch._utils._rebuild_tensor_v2
            self.storage = _StoragePlaceholder(key, getattr(torch, type_name), meta.numel)
            self.extra = ()

    def __reduce_ex__(self, protocol: int) -> Any:
        return (self.rebuild, (self.storage, 0, self.shape, self.stride, False,
                               collections.OrderedDict()) + self.extra)


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StoragePlaceholder):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


def weights_only_safe(value: Any, _depth: int = 0) -> bool:
    """Whether ``torch.load(weights_only=True)`` can load ``value`` (plain containers of
    plain scalars; tensors excluded: they would need their own storages)."""
    if _depth > 50:
        return False
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    if type(value) in (list, tuple):
        return all(weights_only_safe(v, _depth + 1) for v in value)
    if type(value) in (dict, collections.OrderedDict):
        return all(type(k) in (str, int) and weights_only_safe(v, _depth + 1)
                   for k, v in value.items())
    return False


class TorchSaveWriter(Writer):
    """One torch.save file of full tensors; see the module docstring."""

    format_name = "torch"
    file_suffixes = (".pt", ".pth", ".bin", ".ckpt")
    default_file_name = "model.pt"

    def write(self, request: WriteRequest) -> list[str]:
        """Write ``<directory>/<file_name or model.pt>``; return what was dropped."""
        self.objects_written = 0  # the format holds tensors only
        notes: list[str] = []
        tensors = list(request.meta.tensors.values())
        state: dict[str, Any] = {}
        storages: list[tuple[str, TensorMeta]] = []
        for t in tensors:
            key = str(len(storages))
            state[t.key] = _TensorPlaceholder(t, key)
            storages.append((key, t))
        kept, dropped = [], []
        keep = bool(self.options.extra.get("torch_keep_common"))
        for k, v in request.common.items():
            if keep and isinstance(k, str) and k not in state and weights_only_safe(v):
                state[k] = v
                kept.append(k)
            else:
                dropped.append(str(k))
        if dropped:
            why = ("not loadable with weights_only=True, or clashing with a tensor key" if keep
                   else "the file holds tensors only (extra torch_keep_common keeps the "
                        "weights_only-safe ones)")
            notes.append(f"dropped {plural(len(dropped), 'common value')} "
                         f"({', '.join(sorted(dropped))})"
                         f": {why}")
        notes += dropped_objects_note(
            request, "a torch.save file of full tensors has no place for them")

        path = self.directory / (self.options.file_name or "model.pt")
        budget = self.options.max_memory or DEFAULT_MAX_MEMORY
        buf = io.BytesIO()
        _Pickler(buf, protocol=_PICKLE_PROTOCOL).dump(state)
        data = buf.getvalue()
        del buf, state
        with zip_writer_name(path) as target:
            deferred = self._write_zip(target, path, data, storages, request, budget)
        if deferred:
            _fill_records(path, deferred, request, budget)
        return notes

    def _write_zip(self, target: Any, path: Path, data: bytes,
                   storages: list[tuple[str, TensorMeta]], request: WriteRequest,
                   budget: int) -> list[tuple[str, TensorMeta]]:
        """The archive with every record; storages over ``budget`` bytes are only reserved
        (returned as ``(record name, meta)``) and filled afterwards by ``_fill_records``."""
        import torch

        from torch.serialization import _get_storage_alignment, get_crc32_options

        writer = uninterrupted(torch._C.PyTorchFileWriter, target, get_crc32_options(),
                               _get_storage_alignment())
        deferred = []
        try:
            alignment = str(_get_storage_alignment())
            for name, record in (("data.pkl", data), (".format_version", "1"),
                                 (".storage_alignment", alignment), ("byteorder", "little")):
                uninterrupted(writer.write_record, name, record, len(record))
            for key, t in storages:
                name = f"data/{key}"
                if t.nbytes > budget:
                    uninterrupted(writer.write_record_metadata, name, t.nbytes)  # skip_data
                    deferred.append((f"{writer.archive_name()}/{name}", t))
                else:
                    self._write_storage(writer, name, t, request)
        except BaseException as exc:  # finished here, not by its destructor (an abort)
            finish_failed_writer(writer, path, exc)
            raise
        try:
            uninterrupted(writer.write_end_of_file)
        except RuntimeError as exc:
            raise_write_failure(path, exc)
            raise
        return deferred

    @staticmethod
    def _write_storage(writer: Any, name: str, t: TensorMeta, request: WriteRequest) -> None:
        if t.numel == 0:
            uninterrupted(writer.write_record, name, b"", 0)
            return
        piece = pull_piece(request, t, (0,) * len(t.shape), tuple(t.shape))
        if piece.storage_offset() or piece.untyped_storage().nbytes() != t.nbytes:
            piece = piece.clone()  # a view into a larger storage: write only its bytes
        uninterrupted(writer.write_record, name, piece.untyped_storage(), t.nbytes)
        request.progress(t.nbytes)


def _fill_records(path: Path, deferred: list[tuple[str, TensorMeta]], request: WriteRequest,
                  budget: int) -> None:
    """Stream each reserved record's data into place slab by slab, then patch its CRC32 in
    the local header and the central directory (``zipfile.testzip`` passes)."""
    with zipfile.ZipFile(path) as zf:
        infos = {name: zf.getinfo(name) for name, _ in deferred}
        central = _central_entries(path, zf.start_dir, len(zf.infolist()))
    with open(path, "r+b") as f:
        for name, t in deferred:
            info = infos[name]
            f.seek(zip_data_offsets(f, info.header_offset))
            crc = 0
            for offsets, sizes in slab_pieces(t.shape, dtype_itemsize(t.dtype), budget):
                piece = pull_piece(request, t, offsets, sizes)
                data = tensor_bytes(piece)
                f.write(data)
                crc = crc32(data, crc)
                del piece
                request.progress(len(data))
            for at in (info.header_offset + 14, central[name] + 16):
                f.seek(at)
                f.write(struct.pack("<I", crc))


def _central_entries(path: Path, start: int, count: int) -> dict[str, int]:
    """Record name -> offset of its central directory entry."""
    out = {}
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for _ in range(count):
            head = f.read(46)
            if head[:4] != b"PK\x01\x02":
                raise zipfile.BadZipFile(f"bad central directory entry at {pos}")
            n, m, k = struct.unpack("<HHH", head[28:34])
            out[f.read(n).decode("utf-8")] = pos
            f.seek(m + k, 1)
            pos += 46 + n + m + k
    return out
