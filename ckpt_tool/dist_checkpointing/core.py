"""Checkpoint-level configuration: the ``metadata.json`` marker of a distributed checkpoint.

Megatron-Core's ``dist_checkpointing.core`` names; the marker is the format's, so its code lives
in :mod:`ckpt_tool.formats.mcore_dist.config` (readers and writers of the format use it too) and
the exception in :mod:`ckpt_tool.errors`.
"""

from ckpt_tool.errors import CheckpointingException
from ckpt_tool.formats.mcore_dist.config import (
    CONFIG_FNAME,
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    maybe_load_config,
    save_config,
)

from ._mcore_names import MultiStorageClientFeature  # noqa: F401 (re-exported as in MCore)

__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "check_is_distributed_checkpoint",
    "maybe_load_config",
    "save_config",
]
