"""Shared foundations of the sharded-value classes: type aliases, the base class, replicas.

Users import these names from ``ckpt_tool.dist_checkpointing.mapping``; they live here only so
that ``mapping`` and ``sharded_objects`` can share them without importing each other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from numbers import Integral
from typing import Any, Dict, Tuple, Union

__all__ = [
    "StateDict",
    "CommonStateDict",
    "ShardedStateDict",
    "ReplicaId",
    "ShardedBase",
    "is_main_replica",
]

# Type hints only: a plain state dict vs one whose leaves are sharded values.
StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]
ReplicaId = Union[int, Tuple[int, ...]]


class ShardedBase(ABC):
    """Common interface of every sharded value (tensor, object, factory)."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise CheckpointingException if the metadata fields contradict each other."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy of this value with ``data=None`` (metadata only)."""
        raise NotImplementedError


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that gets saved: ``0`` or a tuple of zeros."""
    if isinstance(replica_id, Integral):
        return replica_id == 0
    return all(r == 0 for r in replica_id)
