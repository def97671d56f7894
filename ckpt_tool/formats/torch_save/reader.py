"""A single ``torch.save`` file (a zip: ``<archive>/data.pkl`` + ``<archive>/data/<n>``).

The metadata path unpickles only ``data.pkl`` through the allowlist with tensor placeholders
(:func:`ckpt_tool.formats.common_state.load_torch_free`, no torch import) and walks the
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

import zipfile
from pathlib import Path
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsupportedError
from ckpt_tool.formats.base import Format, Reader, register
from ckpt_tool.formats.containers.torch_zip.tar_form import refuse_tar_form
from ckpt_tool.formats.containers.torch_zip.torch_save_files import (
    LEGACY_MAGIC,
    ZIP_MAGIC,
    flatten_state,
    mmap_safe,
    placeholder_chunk,
    zip_storages,
)
from ckpt_tool.integrity_manifest import is_manifest
from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta

__all__ = ["TorchSaveReader", "TORCH"]

#: What ``ckpt convert --to torch DIR`` writes into a directory DST (no file suffix).
DIR_FILE = "model.pt"


def _in_dir(path: Path) -> Path:
    """``DIR/model.pt`` for a directory that holds it and nothing else (but its manifest),
    else ``path``."""
    if path.is_dir():
        entries = [p.name for p in path.iterdir()
                   if not p.name.startswith(".") and not is_manifest(p.name)]
        if entries == [DIR_FILE] and (path / DIR_FILE).is_file():
            return path / DIR_FILE
    return path


def sniff(path: Path) -> str | None:
    """A zip with an ``*/data.pkl`` entry (or a damaged zip, reported by ``metadata``), or a
    legacy (non-zip) torch.save pickle; also a directory holding only ``model.pt``."""
    path = _in_dir(path)
    if not path.is_file():
        return f"not a file (or a directory holding only {DIR_FILE})"
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
        super().__init__(_in_dir(Path(path)), trust=trust)
        if not self.path.is_file():
            raise InputError("no such file", path=self.path, hint="check the path")
        refuse_tar_form(self.path)
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
        from ckpt_tool.formats.common_state import jsonable, load_torch_free, summarize_common
        from ckpt_tool.formats.containers.pickle.torch_stand_ins import (TensorPlaceholder,
                                                                         dtype_name)

        prefix, storages, byteorder = zip_storages(self.path)  # first: clear damaged-zip errors
        state = load_torch_free(self.path, trust=self.trust)
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
        return placeholder_chunk(self.path, key, t, shape, storages, byteorder)

    def _check(self) -> None:
        """The CRC-32 of every record, before ``torch.load`` (which does not check them)."""
        if self.verify:
            from ckpt_tool.formats.containers.torch_zip.archive_check import check_file

            check_file(self.path)

    def _load(self) -> dict[str, Any]:
        if self._loaded is None:
            import pickle

            import torch

            self._check()
            try:
                state = torch.load(self.path, map_location="cpu", mmap=mmap_safe(self.path),
                               weights_only=True)
            except pickle.UnpicklingError:
                from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

                state = load_torch_file(self.path, trust=self.trust, verify=False)
            except (RuntimeError, EOFError, zipfile.BadZipFile) as exc:
                raise CorruptCheckpointError(f"cannot load the torch.save file ({exc})",
                                             path=self.path) from None
            self._loaded = flatten_state(state)[0]
        return self._loaded

    def stored_archives(self, chunks: Any) -> list[tuple[Path, int | None, int | None]]:
        """The file, whole (see :meth:`Reader.stored_archives`)."""
        return [(self.path, None, None)] if any(True for _ in chunks) else []

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        """The tensor ``key`` (or ``slices`` of it) as a new contiguous tensor."""
        import torch

        from ckpt_tool.formats.containers.dcp.dcp_items import normalize_slices

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

        self._check()
        try:
            state = torch.load(self.path, map_location="cpu", mmap=mmap_safe(self.path),
                           weights_only=True)
        except pickle.UnpicklingError:
            from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

            state = load_torch_file(self.path, trust=self.trust, verify=False)
        return flatten_state(state)[1]

    def close(self) -> None:
        """Drop the mmap-loaded state."""
        self._loaded = None


TORCH = register(Format(
    name="torch", sniff=sniff, open=TorchSaveReader,
    description="single torch.save file (zip archive: data.pkl + raw storages)"))
