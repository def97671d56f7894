"""The ``metadata.json`` marker of a Megatron-Core distributed checkpoint.

A directory is a distributed checkpoint exactly when it holds a ``metadata.json`` that parses
into a :class:`CheckpointingConfig`. The file is written last (by rank 0), so its presence also
means the checkpoint is complete.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Optional


__all__ = [
    "CONFIG_FNAME",
    "CheckpointingConfig",
    "check_is_distributed_checkpoint",
    "maybe_load_config",
    "config_bytes",
    "save_config",
]

CONFIG_FNAME = "metadata.json"


@dataclass
class CheckpointingConfig:
    """Which backends wrote a checkpoint (the content of ``metadata.json``).

    ``sharded_backend`` stores the ShardedTensors/ShardedObjects (``torch_dist``, ``zarr``…),
    ``common_backend`` stores everything else (``torch`` = ``common.pt``; Megatron-Core 0.19
    writes neither field, its common state being a ShardedObject: ``forms``). The versions
    describe the on-disk format of those backends, not the model content.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


def maybe_load_config(checkpoint_dir: Optional[str]) -> Optional[CheckpointingConfig]:
    """Return the :class:`CheckpointingConfig` of ``checkpoint_dir``, or None.

    None means "not a distributed checkpoint": the directory is empty/None or has no
    ``metadata.json``. A ``metadata.json`` that exists but does not describe a config raises
    (JSON errors and unknown fields surface, as in Megatron-Core).
    """
    if not checkpoint_dir:
        return None
    from ckpt_tool.storage import as_path, is_remote

    if is_remote(checkpoint_dir):  # s3:// or msc://
        config = as_path(checkpoint_dir) / CONFIG_FNAME
        if not config.is_file():
            return None
        return CheckpointingConfig(**json.loads(config.read_bytes()))
    config_path = os.path.join(os.fspath(checkpoint_dir), CONFIG_FNAME)
    if not os.path.exists(config_path):
        return None
    with open(config_path, encoding="utf-8") as f:
        fields = json.load(f)
    return CheckpointingConfig(**fields)


def check_is_distributed_checkpoint(checkpoint_dir: Optional[str]) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` with a valid config."""
    return maybe_load_config(checkpoint_dir) is not None


def config_bytes(config: CheckpointingConfig, *, common_backend: bool = True) -> bytes:
    """The exact bytes :func:`save_config` writes for ``config`` (an integrity manifest
    written before the marker lists their digest). ``common_backend=False``: without the
    ``common_backend*`` fields, as Megatron-Core 0.19 writes it (``forms``)."""
    fields = asdict(config)
    if not common_backend:
        fields = {k: v for k, v in fields.items() if not k.startswith("common_backend")}
    return json.dumps(fields).encode("utf-8")


def save_config(config: CheckpointingConfig, checkpoint_dir: str, *,
                common_backend: bool = True) -> None:
    """Write ``config`` as ``<checkpoint_dir>/metadata.json`` (``common_backend``: see
    :func:`config_bytes`).

    The file is staged under a temporary name, fsynced and renamed into place, so a reader
    never sees a half-written marker (and a crash never leaves a checkpoint that looks done).
    """
    checkpoint_dir = os.fspath(checkpoint_dir)
    final_path = os.path.join(checkpoint_dir, CONFIG_FNAME)
    tmp_path = f"{final_path}.tmp.{os.getpid()}"
    try:
        with open(tmp_path, "wb") as f:
            f.write(config_bytes(config, common_backend=common_backend))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, final_path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    _fsync_dir(checkpoint_dir)


def _fsync_dir(path: str) -> None:
    # Persist the rename itself; not every platform/filesystem allows opening a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
