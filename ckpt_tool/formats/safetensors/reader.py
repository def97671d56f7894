"""safetensors: one ``.safetensors`` file, or a directory of them (HF sharded layout).

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [start, end]}, "__metadata__": {...}}``) and the
raw little-endian C-order data; ``data_offsets`` count from the end of the header. A directory
holds ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map": {name: file}}``)
and the files it names, or one or several ``*.safetensors`` files without an index. What
``ckpt convert`` writes beside the model (``optimizer.safetensors``, or its shards and
``optimizer.safetensors.index.json``) is read with it: every index, and the whole files no
index covers.

The metadata path parses the headers itself: no torch import, no tensor bytes read. Each
tensor is one ``raw`` ChunkRef (``byte_offset = 8 + N + start``). Reads fetch only the rows
needed for a slice along dim 0, otherwise map the tensor and slice it.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsupportedError
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.formats.regular_files import inside_name
from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta, dtype_itemsize

__all__ = ["SAFETENSORS_DTYPES", "read_header", "SafetensorsReader", "SAFETENSORS"]

SAFETENSORS_DTYPES: dict[str, str] = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_INDEX = "model" + INDEX_SUFFIX
_SHARD_RE = re.compile(r"-\d+-of-\d+$")
# numpy stand-ins with the same item size (bit-exact; viewed as the torch dtype afterwards).
_NP_PROXY = {"bfloat16": "<u2", "float8_e4m3fn": "u1", "float8_e5m2": "u1", "bool": "?"}


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """``(N, header)`` of a safetensors file; CorruptCheckpointError when it is damaged."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptCheckpointError(
                    f"truncated safetensors file: {size} bytes, not even the 8-byte header "
                    "length", path=path)
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise CorruptCheckpointError(
                    f"header length {n} goes beyond the file size ({size} bytes): truncated "
                    "or not a safetensors file", path=path)
            raw = f.read(n)
    except FileNotFoundError:
        raise InputError("no such file", path=path, hint="check the path") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"safetensors header is not valid JSON ({exc})",
                                     path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError("safetensors header is not a JSON object", path=path)
    return n, header


def _file_tensors(path: Path, rel: str) -> tuple[dict[str, TensorMeta], dict[str, Any]]:
    """The tensors of one file (chunks naming ``rel``) and its ``__metadata__``."""
    n, header = read_header(path)
    data_size = path.stat().st_size - 8 - n
    extra = header.pop("__metadata__", None) or {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in extra.items()):
        raise CorruptCheckpointError("__metadata__ is not a map of strings to strings "
                                     "(safetensors refuses the file)", path=path)
    tensors: dict[str, TensorMeta] = {}
    for key in list(header):
        entry = header.pop(key)  # (each parsed entry freed as its TensorMeta is made)
        _check_key(key, path)
        try:
            code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError) as exc:
            raise CorruptCheckpointError(f"tensor {key!r}: malformed header entry ({exc!r})",
                                         path=path) from None
        if not isinstance(code, str) or not _uints(shape) or not _uints(offsets) \
                or len(offsets) != 2:
            raise CorruptCheckpointError(
                f"tensor {key!r}: malformed header entry (dtype {code!r}, shape {shape!r}, "
                f"data_offsets {offsets!r}: a string, a list of non-negative integers and two "
                "of them; safetensors refuses the file)", path=path)
        shape, (start, end) = tuple(shape), offsets
        dtype = SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise UnsupportedError(f"tensor {key!r}: safetensors dtype {code!r} is not supported",
                                   path=path)
        nbytes = math.prod(shape) * dtype_itemsize(dtype)
        if any(s < 0 for s in shape) or not 0 <= start <= end or end - start != nbytes:
            raise CorruptCheckpointError(
                f"tensor {key!r}: data_offsets [{start}, {end}] do not hold {nbytes} bytes of "
                f"{dtype} {list(shape)}", path=path)
        if end > data_size:
            raise CorruptCheckpointError(
                f"tensor {key!r}: data_offsets end {end} beyond the {data_size} data bytes in "
                "the file (truncated?)", path=path)
        chunk = ChunkRef(offsets=_ZEROS[len(shape)] if len(shape) < len(_ZEROS)
                         else (0,) * len(shape), sizes=shape, file=rel,
                         byte_offset=8 + n + start, byte_length=nbytes, layout="raw")
        tensors[key] = TensorMeta(key=key, dtype=dtype, shape=shape, chunks=(chunk,))
    _check_packed(tensors, data_size, 8 + n, path)
    return tensors, extra


_U64 = 1 << 64
_ZEROS = tuple((0,) * n for n in range(9))  # one tuple of offsets per rank, shared


def _uints(value: Any) -> bool:
    """A JSON list of integers a ``u64``/``usize`` holds, as safetensors parses shapes and
    offsets (a float ``8.0``, a string ``"8"``, ``true`` or a negative number: refused)."""
    if type(value) is not list:
        return False
    for v in value:
        if type(v) is not int or not 0 <= v < _U64:
            return False
    return True


def _check_key(key: str, path: Path) -> None:
    """A tensor name safetensors can hold: valid UTF-8 (a JSON escape of a lone surrogate,
    ``\\ud800``, parses in Python but not in safetensors' parser)."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise CorruptCheckpointError(
            f"tensor name {key.encode('utf-8', 'backslashreplace').decode()!r} is not valid "
            "Unicode (a lone surrogate escape); safetensors refuses the file",
            path=path) from None


def _check_packed(tensors: dict[str, TensorMeta], data_size: int, start: int,
                  path: Path) -> None:
    """The safetensors library's layout rule: the tensors' byte ranges, in offset order, follow
    each other with no gap and no overlap and end exactly at the end of the file (anything
    else, it refuses the whole file)."""
    at = start
    for key, c in sorted(((k, t.chunks[0]) for k, t in tensors.items()),
                         key=lambda kc: (kc[1].byte_offset, kc[1].byte_length)):
        if c.byte_offset != at:
            how = "overlaps the previous tensor" if c.byte_offset < at else "leaves a gap"
            raise CorruptCheckpointError(
                f"tensor {key!r}: data_offsets start {c.byte_offset - start} {how} (ends at "
                f"{at - start}); safetensors refuses the file", path=path)
        at += c.byte_length
    if at != start + data_size:
        raise CorruptCheckpointError(
            f"the tensors cover {at - start} of the {data_size} data bytes (trailing bytes); "
            "safetensors refuses the file", path=path)


def _index_files(d: Path) -> list[Path]:
    """The directory's index files, ``model.safetensors.index.json`` first."""
    found = sorted(d.glob("*" + INDEX_SUFFIX))
    return sorted(found, key=lambda p: p.name != DEFAULT_INDEX)


def sniff(path: Path) -> str | None:
    """A ``.safetensors`` file (or a file with a valid header), or a directory of them."""
    if path.is_dir():
        if _index_files(path) or any(path.glob("*.safetensors")):
            return None
        return "no *.safetensors files or model.safetensors.index.json"
    if not path.is_file():
        return "not a file or directory"
    if path.suffix == ".safetensors":
        return None
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError as exc:
        return str(exc)
    if len(head) < 9:
        return "file too short for a safetensors header"
    (n,) = struct.unpack("<Q", head[:8])
    if 8 + n > size or head[8:9] != b"{":
        return "no safetensors header (8-byte length + JSON)"
    return None


class SafetensorsReader(Reader):
    """Reader for a safetensors file or directory (see the module docstring)."""

    format_name = "safetensors"

    def __init__(self, path: Path, *, trust: bool = False):
        super().__init__(path, trust=trust)
        if not self.path.exists():
            raise InputError("no such file or directory", path=self.path, hint="check the path")
        # Chunk files are relative to ``base``: the directory, or the file's parent.
        self.base = self.path if self.path.is_dir() else self.path.parent
        self._meta: CheckpointMeta | None = None

    def metadata(self) -> CheckpointMeta:
        """Every tensor from the JSON headers; no tensor bytes read, no torch import."""
        if self._meta is not None:
            return self._meta
        extras: dict[str, Any] = {}
        tensors: dict[str, TensorMeta] = {}
        if self.path.is_file():
            tensors, md = _file_tensors(self.path, self.path.name)
            extras.update(files=[self.path.name], metadata=md)
        else:
            indexes = _index_files(self.path)
            if indexes:
                tensors, extras = self._from_indexes(indexes)
            else:
                files = sorted(p.name for p in self.path.glob("*.safetensors"))
                if not files:
                    raise InputError("no *.safetensors files in the directory", path=self.path)
                by_file = {}
                for name in files:
                    ts, md = _file_tensors(self.path / name, name)
                    for k in ts:
                        if k in tensors:
                            raise CorruptCheckpointError(
                                f"tensor {k!r} is stored in both {tensors[k].chunks[0].file} "
                                f"and {name}", path=self.path)
                    tensors.update(ts)
                    by_file[name] = md
                extras.update(files=files, metadata_by_file=by_file)
        self._meta = CheckpointMeta(format=self.format_name, root=str(self.path),
                                    tensors=tensors, extras=extras)
        return self._meta

    def _from_indexes(self, indexes: list[Path]) -> tuple[dict[str, TensorMeta],
                                                          dict[str, Any]]:
        """Every index's tensors (``model`` and ``optimizer``), and the whole files beside
        them that no index covers (``optimizer.safetensors`` beside a sharded model)."""
        tensors, extras = self._from_index(indexes[0])
        covered = set(extras["files"])
        more = [self._from_index(i) for i in indexes[1:]]
        stems = {i.name[: -len(INDEX_SUFFIX)] for i in indexes}
        for f in sorted(self.path.glob("*.safetensors")):
            if f.name not in covered and f.stem not in stems and not _SHARD_RE.search(f.stem) \
                    and all(f.name not in m[1]["files"] for m in more):
                ts, md = _file_tensors(f, f.name)
                more.append((ts, {"files": [f.name], "metadata_by_file": {f.name: md}}))
        for ts, ex in more:
            for k in ts:
                if k in tensors:
                    raise CorruptCheckpointError(
                        f"tensor {k!r} is stored in both {tensors[k].chunks[0].file} and "
                        f"{ts[k].chunks[0].file}", path=self.path)
            tensors.update(ts)
            extras["files"] = sorted(set(extras["files"]) | set(ex["files"]))
            extras["metadata_by_file"] = {**extras["metadata_by_file"], **ex["metadata_by_file"]}
        if len(indexes) > 1:
            extras["indexes"] = [i.name for i in indexes]
        return tensors, extras

    def _from_index(self, index: Path) -> tuple[dict[str, TensorMeta], dict[str, Any]]:
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptCheckpointError(f"{index.name} is not valid JSON ({exc})",
                                         path=self.path) from None
        wmap = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wmap, dict):
            raise CorruptCheckpointError(f"{index.name} has no 'weight_map' object",
                                         path=self.path)
        tensors: dict[str, TensorMeta] = {}
        by_file: dict[str, Any] = {}
        for name in sorted(set(map(str, wmap.values()))):
            try:
                inside_name(name, f"{index.name}: weight_map file", index.name)
            except CorruptCheckpointError as exc:
                exc.path = str(self.path)
                raise
            f = self.path / name
            if not f.is_file():
                raise CorruptCheckpointError(f"{index.name} names {name}, which is missing",
                                             path=self.path)
            ts, md = _file_tensors(f, name)
            by_file[name] = md
            for key, fname in wmap.items():
                if fname == name:
                    if key not in ts:
                        raise CorruptCheckpointError(
                            f"{index.name} maps tensor {key!r} to {name}, which does not hold "
                            "it", path=self.path)
                    tensors[key] = ts[key]
        extras = {"index": index.name, "index_metadata": doc.get("metadata") or {},
                  "files": sorted(by_file), "metadata_by_file": by_file}
        return tensors, extras

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The tensor ``key`` (or ``slices`` of it), bit-exact; reads only the rows needed
        when the slice is along dim 0 only."""
        import numpy as np
        import torch

        from ckpt_tool.formats.containers.dcp.dcp_items import normalize_slices
        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        try:
            meta = self.metadata().tensors[key]
        except KeyError:
            raise InputError(f"no tensor {key!r} in the checkpoint", path=self.path) from None
        region = normalize_slices(meta.shape, slices)
        out_shape = [b - a for a, b in region]
        dt = torch_dtype(meta.dtype)
        chunk = meta.chunks[0]
        file = self.base / str(chunk.file)
        if math.prod(out_shape) == 0:
            return torch.empty(out_shape, dtype=dt)
        itemsize = dtype_itemsize(meta.dtype)
        if all((a, b) == (0, s) for (a, b), s in zip(region[1:], meta.shape[1:])):
            row = math.prod(meta.shape[1:]) * itemsize
            first, last = region[0] if meta.shape else (0, 1)
            want = (last - first) * row
            data = bytearray(want)  # read straight into the tensor's memory (one copy)
            with open(file, "rb") as f:
                f.seek(chunk.byte_offset + first * row)
                got = f.readinto(data)
            if got != want:
                raise CorruptCheckpointError(f"tensor {key!r}: data truncated ({got} of "
                                             f"{want} bytes)", path=file)
            return torch.frombuffer(data, dtype=dt).reshape(out_shape)
        proxy = np.dtype(_NP_PROXY[meta.dtype] if meta.dtype in _NP_PROXY
                         else np.dtype(meta.dtype).newbyteorder("<"))
        mm = np.memmap(file, dtype=proxy, mode="r", offset=chunk.byte_offset,
                       shape=meta.shape)
        part = np.array(mm[tuple(slice(a, b) for a, b in region)], order="C", copy=True)
        del mm
        t = torch.from_numpy(part)
        return t if t.dtype == dt else t.view(dt)


SAFETENSORS = register(Format(
    name="safetensors", sniff=sniff, open=SafetensorsReader,
    description="safetensors file, or a directory of them (model.safetensors.index.json)"))
