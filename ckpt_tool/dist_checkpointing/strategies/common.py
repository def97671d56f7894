"""The ``torch`` common backend: ``common.pt`` and ShardedObjects stored as files.

``common.pt`` is a plain ``torch.save`` of every non-sharded value, written by the coordinator
(rank 0). Backends that cannot store objects themselves (zarr) keep each ShardedObject main
replica as ``<checkpoint>/<key>/shard_<offsets>_<shape>.pt``. Everything is read back through
the allowlisting unpickler of :mod:`ckpt_tool.formats.containers.pickle.safe_pickle`, never plain pickle.

Megatron-Core 0.19 checkpoints have no ``common.pt``: their common state is the
``common_state`` ShardedObject of the torch_dist data (``formats.mcore_dist.forms``), which
:meth:`TorchCommonLoadStrategy.load_common` reads when there is no ``common.pt`` (0.19's
``load_common_state_dict`` reads the file first too).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Union

import torch

from .._mcore_names import MultiStorageClientFeature  # noqa: F401 (re-exported as in MCore)
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, nested_values
from ..mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from ckpt_tool.storage import as_path
from .base import (
    LoadCommonStrategy,
    SaveCommonStrategy,
    StrategyAction,
    register_default_strategy,
)

__all__ = [
    "COMMON_STATE_FNAME",
    "TorchCommonSaveStrategy",
    "TorchCommonLoadStrategy",
    "register_default_common_strategies",
]

COMMON_STATE_FNAME = "common.pt"

logger = logging.getLogger(__name__)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _load_file(path: Union[str, Path], trust: bool = False):
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    return load_torch_file(path, trust=trust, map_location="cpu")


def _common_state_object(checkpoint_dir: Path, trust: bool):
    """The payload of the ``common_state`` object of a torch_dist checkpoint (Megatron-Core
    0.19's common state), or None when it has none."""
    if not (checkpoint_dir / ".metadata").is_file():
        return None
    from ckpt_tool.formats.mcore_dist.reader import TorchDistReader

    with TorchDistReader(checkpoint_dir, trust=trust) as reader:
        keys = sorted(reader.objects_in_common())
        return reader.read_object(keys[0]) if keys else None


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` with ``torch.save`` and ShardedObjects as ``.pt`` files."""

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]):
        """Write ``common.pt`` (rank 0 only)."""
        if _rank() == 0:
            torch.save(common_state_dict, os.path.join(checkpoint_dir, COMMON_STATE_FNAME))

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ):
        """Write each main-replica ShardedObject to ``<unique_key>.pt``."""
        for sh_obj in nested_values(sharded_objects_state_dict):
            if not is_main_replica(sh_obj.replica_id):
                continue
            path = os.path.join(checkpoint_dir, f"{sh_obj.unique_key}.pt")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(sh_obj.data, path)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` and object ``.pt`` files through the allowlisting unpickler.

    Args:
        trust: unpickle without the allowlist (only for checkpoints from a trusted source).
    """

    def __init__(self, trust: bool = False):
        self.trust = trust

    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state dict: ``common.pt``, else (Megatron-Core 0.19) the torch_dist
        data's ``common_state`` object; CheckpointingException when there is neither."""
        path = as_path(checkpoint_dir) / COMMON_STATE_FNAME
        if path.is_file():
            return _load_file(path, self.trust)
        state = _common_state_object(as_path(checkpoint_dir), self.trust)
        if state is None:
            listing = sorted(p.name for p in as_path(checkpoint_dir).iterdir()) \
                if as_path(checkpoint_dir).is_dir() else []
            logger.debug("Checkpoint directory content: %s", listing)
            raise CheckpointingException(
                f"Common file {path} does not exist (nor a common_state object in the "
                "torch_dist data, where Megatron-Core 0.19 keeps the common state)")
        return state

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ):
        """Replace every ShardedObject by its saved value (in place; also returned).

        Falls back to the old file name, which lost the last element of the global shape
        (``shard_0.1_1.2`` was stored as ``shard_0.1_1.pt``: the name went through
        ``with_suffix``), and then to a name without any shape.
        """

        def load_one(sh_obj: ShardedObject):
            root = as_path(checkpoint_dir)
            path = root / f"{sh_obj.unique_key}.pt"
            candidates = [
                path,
                (root / sh_obj.unique_key).with_name(
                    (root / sh_obj.unique_key).stem + ".pt"),
                root / (sh_obj.unique_key.rsplit("_", 1)[0] + ".pt"),
            ]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None:
                raise CheckpointingException(f"Object shard {path} not found")
            return _load_file(found, self.trust)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """ShardedObjects found as ``<key>/shard_*.pt`` files, by unique key.

        Old file names lack the global shape's last axis; it is inferred as the largest last
        offset + 1.
        """
        found = {}
        for subdir in sorted(as_path(checkpoint_dir).iterdir()):
            if not subdir.is_dir():
                continue
            objs = [ShardedObject.empty_from_unique_key(f"{subdir.name}/{f.stem}")
                    for f in sorted(subdir.glob("shard_*.pt"))]
            if not objs:
                continue
            if objs[0].global_shape[-1] < 0:
                last = max(o.global_offset[-1] for o in objs) + 1
                for o in objs:
                    o.global_shape = (*o.global_shape[:-1], last)
            found.update({o.unique_key: o for o in objs})
        return found

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_version):
        pass

    def check_version_compatibility(self, loaded_version):
        pass


def register_default_common_strategies() -> None:
    """Register the ``torch`` common backend, version 1."""
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    register_default_strategy(
        StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1)
    )


register_default_common_strategies()
