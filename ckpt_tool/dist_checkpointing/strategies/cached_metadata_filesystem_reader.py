"""A DCP ``FileSystemReader`` that reads ``.metadata`` once (Megatron-Core's name and behaviour).

Unlike PyTorch's reader it never unpickles with plain ``pickle``: ``.metadata`` goes through
the allowlisting unpickler (``trust=True`` lifts the allowlist, for trusted sources only), and
Megatron-Core's pickled ``MCoreMetadata``/``MCoreSavePlan`` become our stand-in classes.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from torch.distributed.checkpoint import FileSystemReader, Metadata

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
        super().__init__(path=path)
        self.trust = trust
        self._cached_metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's global metadata (read and cached on the first call).

        Per-rank metadata files (``rank=``) are not part of ``torch_dist`` checkpoints:
        asking for one raises FileNotFoundError, which DCP takes as "use the global file".
        """
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("per-rank metadata is not used by torch_dist checkpoints")
        if self._cached_metadata is None:
            from ckpt_tool.formats.dcp_metadata import read_dcp_metadata

            self._cached_metadata = read_dcp_metadata(self.path, trust=self.trust)
        self._cached_metadata.storage_meta.load_id = self.load_id
        return self._cached_metadata
