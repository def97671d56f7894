"""ShardedTensors as values PyTorch DCP can save and load directly (Megatron-Core's API).

DCP (torch >= 2.6) treats any object implementing its ``_Checkpointable`` protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) as a
tensor it can write and read chunk by chunk. :class:`CheckpointableShardedTensor` implements it
for one ShardedTensor: the DCP tensor is the global tensor named by the key, the chunk is the
local piece at its global offset. DCP wants a single value per key and rank, so several local
pieces of one key go into a :class:`LocalShardsContainer`.

The wrappers hold no storage of their own; tensor operations on them raise. A load writes into
the wrapped ShardedTensor's ``data``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..mapping import ShardedTensor

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer", "ShardedTensor"]


def _no_tensor_ops(cls, func):
    return NotImplementedError(
        f"{cls.__name__}.__torch_dispatch__ not implemented. {cls.__name__} shouldn't be used "
        f"with Tensor operations (called {func}).")


class CheckpointableShardedTensor(torch.Tensor):
    """One ShardedTensor seen by DCP as its chunk of the global tensor ``key``.

    Its size, dtype and device are those of the global tensor and the local data. Leading
    axes the data lacks (``prepend_axis_num``) are size-1 axes of the chunk.

    Args:
        data: the local tensor (``sh_ten.data``).
        sh_ten: the ShardedTensor it belongs to (not flattened).
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(sh_ten.global_shape), dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wrap ``sh_ten`` (which must have ``data``)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise TypeError(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def _chunk(self) -> ChunkStorageMetadata:
        sh = self._sh_ten
        sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
        if tuple(sh.data.shape) != tuple(sh.local_shape):
            raise ValueError(f"data of shape {tuple(sh.data.shape)} is not the local shape "
                             f"{tuple(sh.local_shape)} of {sh.key}")
        return ChunkStorageMetadata(offsets=torch.Size(sh.global_offset), sizes=torch.Size(sizes))

    def __create_write_items__(self, fqn: str, sh_ten: "CheckpointableShardedTensor",
                               index: Optional[int] = None) -> List[WriteItem]:
        """The one DCP write item of the chunk (``index``: position in a container)."""
        chunk = sh_ten._chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets, index),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk,
                properties=TensorProperties.create_from_tensor(sh_ten._sh_ten.data),
                size=torch.Size(sh_ten._sh_ten.global_shape),
            ),
        )]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The chunk this rank holds (what a load reads into)."""
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The local data, shaped like the chunk (a view sharing its storage)."""
        data = self._sh_ten.data
        return data.view((1,) * self._sh_ten.prepend_axis_num + tuple(data.shape))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _no_tensor_ops(cls, func)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several CheckpointableShardedTensors of one key held by this rank, as one DCP value.

    Args:
        local_shards: the pieces (at least one; all of the same global tensor).
    """

    @staticmethod
    def __new__(cls, local_shards: List[CheckpointableShardedTensor]):
        if not local_shards:
            raise ValueError("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(
            cls, first.size(), dtype=first.dtype, device=first.device)

    def __init__(self, local_shards: List[CheckpointableShardedTensor]):
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise TypeError(f"expected CheckpointableShardedTensor, got {type(shard).__name__}")
        self._local_shards = list(local_shards)

    def __create_write_items__(self, fqn: str,
                               local_shards_cont: "LocalShardsContainer") -> List[WriteItem]:
        """The write items of every piece; each carries its position as the index hint."""
        items: List[WriteItem] = []
        for n, shard in enumerate(local_shards_cont._local_shards):
            items += shard.__create_write_items__(fqn, shard, index=n)
        return items

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The chunks of every piece, in order."""
        return [c for shard in self._local_shards for c in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The piece at ``index.offset`` (tried first at position ``index.index``).

        Raises ValueError without an offset or when no piece starts there.
        """
        if index.offset is None:
            raise ValueError(
                f"Cannot lookup {index.fqn} for a LocalShardsContainer without an offset")
        shards = self._local_shards
        hint = index.index
        if hint is not None and hint < len(shards) and \
                torch.Size(shards[hint]._sh_ten.global_offset) == index.offset:
            return shards[hint].__get_tensor_shard__(index)
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _no_tensor_ops(cls, func)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._local_shards!r})"
