"""The PyTorch DCP save planner of Megatron-Core's ``torch_dist`` format (our strategy's writes).

DCP does the file format and the I/O; these classes only say *what* to write:

- every main-replica ShardedTensor is one DCP shard of the global tensor named by its key,
  at its global offset (prepended axes become leading size-1 axes of the chunk);
- every ShardedObject is a bytes item under its ``unique_key`` holding ``torch.save([data])``;
- ``Metadata.all_local_plans`` carries the rank-local plans, as Megatron-Core >= 0.11 writes.

These are our strategy's save internals. Loads go through Megatron-Core's own load planner,
:class:`~._mcore_planners.MCoreLoadPlanner`, on the state dict of :mod:`._load_requests`.
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckpt_tool.formats.containers.dcp.dcp_streaming import McoreFileSystemWriter

from ..core import CheckpointingException
from ..dict_utils import nested_values
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader


def check_not_flattened(sh_ten: ShardedTensor) -> None:
    """Raise if ``sh_ten`` is a flattened shard: ``torch_dist`` saves and loads whole chunks."""
    if getattr(sh_ten, "flattened_range", None) is not None:
        raise CheckpointingException(
            f"ShardedTensor.flattened_range is not supported (key {sh_ten.key})")


def _chunk_view(sh_ten: ShardedTensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with the ShardedTensor's prepended axes as leading size-1 dims (a view)."""
    for _ in range(sh_ten.prepend_axis_num):
        tensor = tensor.unsqueeze(0)
    return tensor


class WriteTable:
    """What one rank writes: tensor chunks by (key, offsets) and serialized objects by key."""

    def __init__(self) -> None:
        self.chunks: Dict[Tuple[str, Tuple[int, ...]], Tuple[torch.Tensor, Tuple[int, ...]]] = {}
        self.objects: Dict[str, io.BytesIO] = {}

    @classmethod
    def of(cls, sharded_state_dict: ShardedStateDict,
           keep_only_main_replica: bool = True) -> "WriteTable":
        """What this rank writes of ``sharded_state_dict``: its (main-replica) ShardedTensors
        as chunks, its ShardedObjects as lists of values by unique key."""
        table = cls()
        objects: Dict[str, List[Any]] = {}
        for sh in nested_values(sharded_state_dict):
            if keep_only_main_replica and not is_main_replica(sh.replica_id):
                continue
            if isinstance(sh, ShardedObject):
                objects.setdefault(sh.unique_key, []).append(sh.data)
            elif isinstance(sh, ShardedTensor):
                check_not_flattened(sh)
                if sh.data is None:
                    raise CheckpointingException(f"`data` attr is None for {sh}")
                data = _chunk_view(sh, sh.data.detach()).contiguous()
                table.add_chunk(sh.key, sh.global_offset, data, sh.global_shape)
            else:
                raise CheckpointingException(f"Cannot save {type(sh).__name__} {sh}")
        for key, values in objects.items():
            table.add_objects(key, values)
        return table

    def add_chunk(self, key: str, offsets: Sequence[int], data: torch.Tensor,
                  global_shape: Sequence[int]) -> None:
        """Register ``data`` (already shaped like the chunk) at ``offsets`` of ``key``."""
        ident = (key, tuple(offsets))
        if ident in self.chunks:
            raise CheckpointingException(f"Chunk of {key} at {tuple(offsets)} given twice")
        self.chunks[ident] = (data, tuple(global_shape))

    def add_objects(self, unique_key: str, values: List[Any]) -> None:
        """Serialize ``values`` like Megatron-Core does: ``torch.save`` of the list."""
        buf = io.BytesIO()
        torch.save(values, buf)
        buf.seek(0)
        self.objects[unique_key] = buf

    def write_items(self) -> List[WriteItem]:
        items = []
        for (key, offsets), (data, global_shape) in self.chunks.items():
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(data.shape)),
                    properties=TensorProperties.create_from_tensor(data),
                    size=torch.Size(global_shape),
                ),
            ))
        items += [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO)
                  for k in self.objects]
        return items


class TableSavePlanner(DefaultSavePlanner):
    """Writes a :class:`WriteTable` on every rank (no coordinator-only items, no flattening)."""

    def __init__(self, table: WriteTable):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.table = table
        # nothing to deduplicate or flatten: a rank's global plan is its local plan
        self.can_run_decentralized_global_plan = True

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(items=self.table.write_items(), planner_data={})
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        # DCP validates the global plan (chunk overlap and bounds) while building the metadata
        global_plans, metadata = super().create_global_plan(all_plans)
        metadata.all_local_plans = list(all_plans)
        return global_plans, metadata

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """This rank's global plan, made without the other ranks: its local plan."""
        return local_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return self.table.objects[write_item.index.fqn]
        return self.table.chunks[(write_item.index.fqn, tuple(write_item.index.offset))][0]


# Earlier names, kept for existing callers. Not Megatron-Core's MCoreSavePlanner (different
# arguments): that is in ._mcore_planners.
McoreSavePlanner = TableSavePlanner
SafeFileSystemReader = CachedMetadataFileSystemReader
