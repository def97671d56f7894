"""Strategy interfaces and the registry of default strategies.

A *strategy* moves one part of a checkpoint: the sharded part (ShardedTensors and, for
backends that can, ShardedObjects) or the common part (everything else, ``common.pt``). The
backend and version a save strategy writes are recorded in ``metadata.json``; on load the
recorded pair selects the default load strategy. Names and behaviour follow Megatron-Core.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Tuple, Union

from ..core import CheckpointingException
from ..mapping import ShardedStateDict, StateDict
from .async_utils import AsyncCallsQueue, AsyncRequest

__all__ = [
    "StrategyAction",
    "default_strategies",
    "get_default_strategy",
    "register_default_strategy",
    "LoadStrategyBase",
    "SaveStrategyBase",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "AsyncSaveShardedStrategy",
    "async_calls",
]


class StrategyAction(Enum):
    """Which part of a checkpoint a strategy handles, and in which direction."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


# action value -> {(backend, version): strategy instance}
default_strategies: Dict[str, Dict[Tuple[str, int], Any]] = {a.value: {} for a in StrategyAction}

# A module-wide queue, as in Megatron-Core (which defines but does not use it). Creating it
# starts nothing: worker processes come with the first scheduled request.
async_calls = AsyncCallsQueue()

# modules whose import registers the default strategies of a backend (imported on demand, so
# e.g. tensorstore/zarr are only imported when a zarr checkpoint is met)
_BACKEND_MODULES = {
    "torch": ".common",
    "torch_dist": ".torch",
    "zarr": ".zarr",
}


def register_default_strategy(
    action: StrategyAction,
    backend: str,
    version: int,
    strategy: Union["SaveStrategyBase", "LoadStrategyBase"],
) -> None:
    """Make ``strategy`` the default for ``action`` on checkpoints of ``(backend, version)``."""
    default_strategies[action.value][(backend, version)] = strategy


def get_default_strategy(action: StrategyAction, backend: str, version: int):
    """The registered default strategy for ``action`` and ``(backend, version)``.

    Raises CheckpointingException when the backend's module cannot be imported or registers
    nothing for that pair.
    """
    registry = default_strategies[action.value]
    if (backend, version) not in registry and backend in _BACKEND_MODULES:
        try:
            importlib.import_module(_BACKEND_MODULES[backend], __package__)
        except ImportError as e:
            raise CheckpointingException(
                f"Cannot import a default strategy for: {(action.value, backend, version)}. "
                f"Error: {e}"
            ) from e
    try:
        return registry[(backend, version)]
    except KeyError as e:
        raise CheckpointingException(
            f"Cannot find a default strategy for: {(action.value, backend, version)}"
        ) from e


class LoadStrategyBase(ABC):
    """A load strategy: checks that it can read a checkpoint's backend and version."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend):
        """Raise CheckpointingException if this strategy cannot read ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version):
        """Raise CheckpointingException if this strategy cannot read ``loaded_version``."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy loads ShardedObjects itself."""
        return False


class SaveStrategyBase(ABC):
    """A save strategy: writes the format identified by ``backend`` and ``version``."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether this strategy saves ShardedObjects itself."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common (non-sharded) part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Union[str, Path]) -> StateDict:
        """The common state dict of ``checkpoint_dir``."""

    @abstractmethod
    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ):
        """Replace the ShardedObjects of the given state dict by their saved values."""

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """ShardedObjects (without data) saved in ``checkpoint_dir``, by unique key."""
        if not self.can_handle_sharded_objects:
            return {}
        raise NotImplementedError


class LoadShardedStrategy(LoadStrategyBase):
    """Loads the sharded part of a checkpoint."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Load the values requested by ``sharded_state_dict`` (same structure, plain values)."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]):
        """Every saved tensor as a data-less, unsharded ShardedTensor keyed by its key.

        Only the key, dtype and global shape are meaningful.
        """

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]):
        """Like :meth:`load_tensors_metadata`, plus ShardedObjects keyed by unique key."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(
            f"Loading only sharded metadata not implemented for {type(self).__name__}"
        )

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str):
        """Remove every tensor whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) part of a state dict."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Union[str, Path]):
        """Write ``common_state_dict`` (once, from the coordinator rank)."""

    def save_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ):
        """Write the main replicas of the given ShardedObjects."""
        raise NotImplementedError


class SaveShardedStrategy(SaveStrategyBase):
    """Saves the sharded part of a state dict."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Write the main replicas of the sharded values of ``sharded_state_dict``."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy that can split its work into an :class:`AsyncRequest`."""

    @abstractmethod
    def async_save(
        self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]
    ) -> AsyncRequest:
        """Plan the save and return the request that performs and finalizes it.

        The caller schedules the request (possibly in the background); nothing is complete
        until its finalize functions ran on every rank.
        """

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Union[str, Path]):
        """Run :meth:`async_save`'s request synchronously."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
