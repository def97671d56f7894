"""A DCP ``FileSystemReader`` that reads ``.metadata`` once (Megatron-Core's name and behaviour).

Unlike PyTorch's reader it never unpickles with plain ``pickle``: ``.metadata`` goes through
the allowlisting unpickler (``trust=True`` lifts the allowlist, for trusted sources only), and
Megatron-Core's pickled ``MCoreMetadata``/``MCoreSavePlan`` become our stand-in classes.

An ``s3://`` or ``msc://`` path (``ckpt_tool.storage``) is read with ranged GETs: each stored
item is fetched whole (parallel parts when big) and handed to DCP from memory.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any, Iterator, Optional, Union

from torch.distributed.checkpoint import FileSystemReader, Metadata
from torch.distributed.checkpoint.filesystem import FileSystemBase

from ckpt_tool.storage import as_path, is_remote, read_into

__all__ = ["CachedMetadataFileSystemReader"]


class CachedMetadataFileSystemReader(FileSystemReader):
    """Reads a DCP checkpoint; its metadata is read from storage on the first call only.

    Later :meth:`read_metadata` calls return the same object (so changes to the file after
    the first read are not seen), which lets a load plan and then query the metadata without
    a second storage round trip.

    Args:
        path: the checkpoint directory.
        trust: unpickle ``.metadata`` without the allowlist (trusted sources only).
    """

    def __init__(self, path: Union[str, os.PathLike], trust: bool = False) -> None:
        remote = is_remote(path)
        super().__init__(path="." if remote else path)
        if remote:
            self.fs = _ObjectStore()
            self.path = as_path(path)
        self.trust = trust
        self._cached_metadata: Optional[Metadata] = None

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        if isinstance(file, _Object):  # one ranged read of the item, not a read per record
            data = bytearray(sinfo.length)
            if read_into(file.path, sinfo.offset, data) != sinfo.length:
                from ckpt_tool.errors import CorruptCheckpointError

                raise CorruptCheckpointError(
                    f"data file {file.path.name} is truncated: item at {sinfo.offset} needs "
                    f"{sinfo.length} bytes", path=file.path.parent)
            return io.BytesIO(data)
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's global metadata (read and cached on the first call).

        Per-rank metadata files (``rank=``) are not part of ``torch_dist`` checkpoints:
        asking for one raises FileNotFoundError, which DCP takes as "use the global file".
        """
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("per-rank metadata is not used by torch_dist checkpoints")
        if self._cached_metadata is None:
            from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata

            self._cached_metadata = read_dcp_metadata(self.path, trust=self.trust)
        self._cached_metadata.storage_meta.load_id = self.load_id
        return self._cached_metadata


class _Object:
    """What :class:`_ObjectStore` opens: the object's path (its items are read by range)."""

    def __init__(self, path: Any):
        self.path = path


class _ObjectStore(FileSystemBase):
    """DCP's file-system hooks over an object store, for reading."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if mode != "rb":
            raise io.UnsupportedOperation("objects are read here, never written")
        if path.name.endswith(".metadata"):
            with path.open("rb") as f:
                yield f
        else:
            yield _Object(path)

    def concat_path(self, path: Any, suffix: str) -> Any:
        return as_path(path) / suffix

    def init_path(self, path: Any) -> Any:
        return as_path(path)

    def rename(self, path: Any, new_path: Any) -> None:
        raise io.UnsupportedOperation("read only")

    def mkdir(self, path: Any) -> None:
        raise io.UnsupportedOperation("read only")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return is_remote(checkpoint_id)

    def exists(self, path: Any) -> bool:
        return as_path(path).exists()

    def rm_file(self, path: Any) -> None:
        raise io.UnsupportedOperation("read only")
