"""Sharded values other than tensors: objects, factories and non-persistent wrappers.

Re-exported by ``ckpt_tool.dist_checkpointing.mapping`` (their Megatron-Core import path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch

from ._base import ReplicaId, ShardedBase, ShardedStateDict, StateDict
from ._shard_math import parse_object_unique_key
from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace

__all__ = [
    "LocalNonpersistentObject",
    "ShardedObject",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "ShardedTensorFactory",
    "apply_factories",
    "apply_factory_merges",
]

logger = logging.getLogger(__name__)


class LocalNonpersistentObject:
    """Wraps a state-dict value that is never saved but restored from the local value.

    On save the wrapped object is dropped; on load ``unwrap()`` of it is put in the loaded
    state dict at the same place.
    """

    def __init__(self, obj: Any):
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped object."""
        return self.obj

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.obj!r})"


@dataclass
class ShardedObject(ShardedBase):
    """An arbitrary (picklable) local object that is one cell of a global grid of objects.

    Unlike tensors, objects cannot be resharded: a load must ask for exactly the cells that
    were saved.

    Args:
        key: name of the global object.
        data: the local object; None when only the metadata is needed.
        global_shape: shape of the grid of objects.
        global_offset: position of this object in the grid.
        replica_id: see :class:`ShardedTensor`.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"Global offset dimensions should be equal to global shape dimensions for {self}"
            )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``<key>/shard_<offset>_<shape>`` with dot-joined numbers, e.g. ``rng/shard_0.1_1.2``."""
        offset = ".".join(str(i) for i in self.global_offset)
        shape = ".".join(str(i) for i in self.global_shape)
        return f"{self.key}/shard_{offset}_{shape}"

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Rebuild a data-less ShardedObject from its :attr:`unique_key`.

        Old checkpoints may lack the trailing global-shape element (or the whole shape part);
        unknown sizes are then -1.
        """
        try:
            key, offset, shape = parse_object_unique_key(unique_key)
        except ValueError as e:
            raise CheckpointingException(str(e)) from None
        return cls(key, None, shape, offset, replica_id)


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Turns one tensor into a sub-state-dict of sharded values for saving, and back on load.

    ``build_fn(key, data, replica_id, flattened_range)`` produces the sharded sub-state-dict
    that gets saved; ``merge_fn(loaded_sub_state_dict)`` is its inverse and returns the tensor.
    Because the result depends only on those arguments, the optimizer can reuse the model's
    factory for its own states (with a different key and data).
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        """Run ``build_fn`` on this factory's fields."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check: the built values are validated themselves."""

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every :class:`ShardedTensorFactory` by what it builds, in place."""

    def build(x):
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(build, sharded_state_dict)


def apply_factory_merges(x1: StateDict, x2: ShardedStateDict, key: Tuple = ()) -> StateDict:
    """Undo :func:`apply_factories` on a loaded state dict, in place.

    ``x2`` mirrors (a subset of) ``x1``'s structure with factories as leaves: each factory's
    ``merge_fn`` is applied to the ``x1`` subtree at the same place. A dict in ``x2`` may
    address a list in ``x1`` by integer keys. Structural mismatches raise ValueError.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)

    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, sub in x2.items():
            if k not in x1:
                raise ValueError(
                    f"Different dict keys encountered in `apply_factory_merges` "
                    f"({x1.keys()} vs {x2.keys()})"
                )
            x1[k] = apply_factory_merges(x1[k], sub, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            msg = (
                f"Cannot merge two lists with different lengths "
                f"({len(x1)} and {len(x2)}, encountered at key {key})"
            )
            logger.error("%s\nx1: %s\nx2: %s", msg, x1, x2)
            raise ValueError(msg)
        for i, sub in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], sub, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, sub in x2.items():
            if not isinstance(k, int):
                raise ValueError(
                    f"Invalid dict key {k} non-integer type encountered "
                    f"in a list-dict merge at level {key}"
                )
            if k >= len(x1):
                raise ValueError(
                    f"Dict key {k} out of bound for list of length "
                    f"{len(x1)} (encountered at level {key})"
                )
            x1[k] = apply_factory_merges(x1[k], sub, key + (k,))
    else:
        raise ValueError(
            f"Duplicate non-dict and non-list values encountered: `{x1}` and `{x2}` "
            f"(at key {key})"
        )
    return x1
