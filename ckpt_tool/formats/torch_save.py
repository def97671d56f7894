"""A single ``torch.save`` file (a zip: ``<archive>/data.pkl`` + ``<archive>/data/<n>``).

The metadata path unpickles only ``data.pkl`` through the allowlist with tensor placeholders
(:func:`ckpt_tool.formats._common.load_torch_save_light`, no torch import) and walks the
(nested) state: each tensor becomes a TensorMeta keyed by its dotted path (dict keys and
list indices joined by ``"."``); every other value goes, JSON-safe, into ``common``.

Storages are stored uncompressed in the zip; the data offset of ``<archive>/data/<n>`` comes
from the entry's local file header. A contiguous tensor is one ``raw`` ChunkRef at
``data offset + storage_offset * itemsize`` in the file; a non-contiguous one gets a
``torch_save`` chunk without a byte range (read it through the reader). Legacy (pre-1.6,
non-zip) ``torch.save`` files are recognised and refused with UnsupportedError.

``read`` uses ``torch.load(mmap=True, weights_only=True)``, falling back to the allowlisting
unpickler when the restricted load refuses a global (``argparse.Namespace``, ...).
"""

from __future__ import annotations

import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsupportedError
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta, dtype_itemsize

__all__ = ["LEGACY_MAGIC", "flatten_state", "zip_data_offsets", "TorchSaveReader", "TORCH"]

ZIP_MAGIC = b"PK\x03\x04"
# A legacy torch.save file starts with the pickled magic number 0x1950a86a20f9469cfc6c.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def _is_tensor(v: Any) -> bool:
    from ckpt_tool.formats._torch_stubs import TensorPlaceholder

    if isinstance(v, TensorPlaceholder):
        return True
    return type(v).__module__.startswith("torch") and hasattr(v, "shape") and hasattr(v, "dtype")


def flatten_state(obj: Any, prefix: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, others)``: leaves of nested dicts/lists/tuples keyed by dotted path."""
    tensors: dict[str, Any] = {}
    others: dict[str, Any] = {}

    def walk(v: Any, key: str) -> None:
        if _is_tensor(v):
            tensors[key or "<root>"] = v
        elif isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{key}.{k}" if key else str(k))
        elif isinstance(v, (list, tuple)) and v and any(_holds_tensor(x) for x in v):
            for i, x in enumerate(v):
                walk(x, f"{key}.{i}" if key else str(i))
        else:
            others[key or "<root>"] = v

    walk(obj, prefix)
    return tensors, others


def _holds_tensor(v: Any) -> bool:
    if _is_tensor(v):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def _zip_info(path: Path) -> tuple[str, dict[str, tuple[int, int]], str]:
    """``(archive prefix, {storage key: (data offset, size)}, byteorder)`` of a torch.save zip."""
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as raw:
            pkls = sorted((n for n in zf.namelist() if n.endswith("/data.pkl")), key=len)
            if not pkls:
                raise CorruptCheckpointError("zip file without */data.pkl: not a torch.save file",
                                             path=path)
            prefix = pkls[0][: -len("data.pkl")]
            byteorder = "little"
            if prefix + "byteorder" in zf.NameToInfo:
                byteorder = zf.read(prefix + "byteorder").decode("ascii", "replace").strip()
            offsets = {}
            for info in zf.infolist():
                if not info.filename.startswith(prefix + "data/"):
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    continue  # no raw byte range; reads go through torch.load
                offsets[info.filename[len(prefix + "data/"):]] = (
                    zip_data_offsets(raw, info.header_offset), info.file_size)
    except (zipfile.BadZipFile, OSError, EOFError, struct.error) as exc:
        raise CorruptCheckpointError(f"damaged zip archive ({exc})", path=path) from None
    return prefix, offsets, byteorder


def zip_data_offsets(raw: Any, header_offset: int) -> int:
    """Where an entry's data starts: after its local file header (30 bytes + name + extra)."""
    raw.seek(header_offset)
    head = raw.read(30)
    if len(head) != 30 or head[:4] != ZIP_MAGIC:
        raise zipfile.BadZipFile(f"bad local file header at {header_offset}")
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return header_offset + 30 + name_len + extra_len


def sniff(path: Path) -> str | None:
    """A zip with an ``*/data.pkl`` entry (or a damaged zip, reported by ``metadata``), or a
    legacy (non-zip) torch.save pickle."""
    if not path.is_file():
        return "not a file"
    try:
        with open(path, "rb") as f:
            head = f.read(len(LEGACY_MAGIC))
    except OSError as exc:
        return str(exc)
    if head.startswith(LEGACY_MAGIC):
        return None
    if not head.startswith(ZIP_MAGIC):
        return "not a zip archive or a torch.save pickle"
    try:
        with zipfile.ZipFile(path) as zf:
            if any(n.endswith("/data.pkl") for n in zf.namelist()):
                return None
    except (zipfile.BadZipFile, OSError):
        return None  # a damaged (e.g. truncated) archive: metadata() says what is wrong
    return "zip archive without */data.pkl"


class TorchSaveReader(Reader):
    """Reader for one ``torch.save`` file (see the module docstring)."""

    format_name = "torch"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        if not self.path.is_file():
            raise InputError("no such file", path=self.path, hint="check the path")
        with open(self.path, "rb") as f:
            if f.read(len(LEGACY_MAGIC)) == LEGACY_MAGIC:
                raise UnsupportedError(
                    "legacy (non-zip, PyTorch < 1.6) torch.save file is not supported",
                    path=self.path,
                    hint="re-save it with a recent torch: torch.save(torch.load(f), f2)")
        self._meta: CheckpointMeta | None = None
        self._loaded: dict[str, Any] | None = None

    def metadata(self) -> CheckpointMeta:
        """Every tensor of the pickled state and a JSON-safe summary of the rest; reads only
        ``data.pkl`` and zip headers (no torch import unless the pickle needs real torch)."""
        if self._meta is not None:
            return self._meta
        from ckpt_tool.formats._common import jsonable, load_torch_save_light, summarize_common
        from ckpt_tool.formats._torch_stubs import TensorPlaceholder, dtype_name

        prefix, storages, byteorder = _zip_info(self.path)  # first: clear damaged-zip errors
        state = load_torch_save_light(self.path, trust=self.trust)
        tensors_raw, others = flatten_state(state)
        tensors: dict[str, TensorMeta] = {}
        non_contiguous = []
        for key, t in tensors_raw.items():
            shape = tuple(int(s) for s in t.shape)
            if isinstance(t, TensorPlaceholder):
                dtype, chunk = t.dtype, self._chunk(key, t, shape, storages, byteorder)
            else:  # a real tensor (the pickle needed torch): no byte range
                dtype, chunk = dtype_name(t.dtype), None
            if chunk is None:
                non_contiguous.append(key)
                chunk = ChunkRef(offsets=(0,) * len(shape), sizes=shape, file=self.path.name,
                                 layout="torch_save")
            tensors[key] = TensorMeta(key=key, dtype=dtype, shape=shape, chunks=(chunk,),
                                      origin=None if not isinstance(t, TensorPlaceholder)
                                      or t.storage is None else f"{prefix}data/{t.storage.key}")
        common = summarize_common(state) if isinstance(state, dict) else {}
        common["values"] = {k: jsonable(v) for k, v in others.items()}
        extras = {"archive": prefix.rstrip("/"), "byteorder": byteorder,
                  "storages": len(storages), "without_byte_range": sorted(non_contiguous)}
        self._meta = CheckpointMeta(format=self.format_name, root=str(self.path),
                                    tensors=tensors, common=common, extras=extras)
        return self._meta

    def _chunk(self, key: str, t: Any, shape: tuple[int, ...],
               storages: dict[str, tuple[int, int]], byteorder: str) -> ChunkRef | None:
        """A raw ChunkRef for a contiguous little-endian tensor, else ``None``."""
        if t.storage is None or t.storage.key not in storages or byteorder != "little":
            return None
        expect, stride = 1, []
        for s in reversed(shape):
            stride.insert(0, expect)
            expect *= s
        numel = math.prod(shape)
        if t.stride is not None and numel > 1 and any(
                st != e for st, e, s in zip(t.stride, stride, shape) if s > 1):
            return None
        itemsize = dtype_itemsize(t.dtype)
        data_offset, size = storages[t.storage.key]
        start, length = t.storage_offset * itemsize, numel * itemsize
        if start + length > size:
            raise CorruptCheckpointError(
                f"tensor {key!r}: needs bytes [{start}, {start + length}) of storage "
                f"{t.storage.key}, which holds {size}", path=self.path)
        return ChunkRef(offsets=(0,) * len(shape), sizes=shape, file=self.path.name,
                        byte_offset=data_offset + start, byte_length=length, layout="raw")

    def _load(self) -> dict[str, Any]:
        if self._loaded is None:
            import pickle

            import torch

            try:
                state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            except pickle.UnpicklingError:
                from ckpt_tool.formats._pickle import load_torch_file

                state = load_torch_file(self.path, trust=self.trust)
            except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
                raise CorruptCheckpointError(f"cannot load the torch.save file ({exc})",
                                             path=self.path) from None
            self._loaded = flatten_state(state)[0]
        return self._loaded

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The tensor ``key`` (or ``slices`` of it) as a new contiguous tensor."""
        import torch

        from ckpt_tool.formats._dcp_io import normalize_slices

        tensors = self._load()
        if key not in tensors:
            raise InputError(f"no tensor {key!r} in the checkpoint", path=self.path)
        t = tensors[key]
        region = normalize_slices(tuple(t.shape), slices)
        return t[tuple(slice(a, b) for a, b in region)].clone(
            memory_format=torch.contiguous_format)

    def common(self) -> dict[str, Any]:
        """The non-tensor values of the state (dotted keys), loaded with torch."""
        import pickle

        import torch

        try:
            state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:
            from ckpt_tool.formats._pickle import load_torch_file

            state = load_torch_file(self.path, trust=self.trust)
        return flatten_state(state)[1]

    def close(self) -> None:
        """Drop the mmap-loaded state."""
        self._loaded = None


TORCH = register(Format(
    name="torch", sniff=sniff, open=TorchSaveReader,
    description="single torch.save file (zip archive: data.pkl + raw storages)"))
