"""PyTorch DCP planners, reader and writer specialised for Megatron-Core's ``torch_dist`` format.

DCP does the file format, the read planning (intersecting requested chunks with saved ones)
and the I/O; these classes only say *what* to write or read:

- every main-replica ShardedTensor is one DCP shard of the global tensor named by its key,
  at its global offset (prepended axes become leading size-1 axes of the chunk);
- every ShardedObject is a bytes item under its ``unique_key`` holding ``torch.save([data])``;
- ``Metadata.all_local_plans`` carries the rank-local plans, as Megatron-Core >= 0.11 writes.

These are our strategy's internals. Megatron-Core's own planners, which work on the state dicts
of :func:`~.torch.mcore_to_pyt_state_dict`, are :mod:`._mcore_planners`.
"""

from __future__ import annotations

import io
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.utils import _wrap_exception

from ckpt_tool.formats.dcp_streaming import McoreFileSystemWriter

from ..core import CheckpointingException
from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


class WriteTable:
    """What one rank writes: tensor chunks by (key, offsets) and serialized objects by key."""

    def __init__(self) -> None:
        self.chunks: Dict[Tuple[str, Tuple[int, ...]], Tuple[torch.Tensor, Tuple[int, ...]]] = {}
        self.objects: Dict[str, io.BytesIO] = {}

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


class TensorRequest:
    """One requested region of a saved tensor and where its values go.

    ``target`` is shaped like the region (prepended axes included). For a tensor stored
    N-D reformulated (Megatron-Core <= 0.15 flattened optimizer state) the read goes into a
    block buffer that :meth:`finish` rearranges into ``target``.
    """

    def __init__(self, key: str, offsets: Tuple[int, ...], target: torch.Tensor):
        self.key, self.offsets, self.target = key, offsets, target
        self.buffer: Optional[torch.Tensor] = None
        self.block: Optional[Tuple[int, ...]] = None
        self.first_block: Optional[Tuple[int, ...]] = None

    def read_box(self, stored_shape: Sequence[int], orig_shape: Optional[Sequence[int]]) -> Box:
        """The region to read from the stored tensor (its own index space)."""
        sizes = tuple(self.target.shape)
        if orig_shape is None:
            return self.offsets, sizes
        block = tuple(o // s for o, s in zip(orig_shape, stored_shape[:-1]))
        if math.prod(block) != stored_shape[-1]:
            raise CheckpointingException(
                f"Cannot undo the N-D reformulation of {self.key}: stored {tuple(stored_shape)},"
                f" original {tuple(orig_shape)}")
        first = tuple(o // b for o, b in zip(self.offsets, block))
        last = tuple(-(-(o + s) // b) for o, s, b in zip(self.offsets, sizes, block))
        counts = tuple(e - f for f, e in zip(first, last))
        self.block, self.first_block = block, first
        self.buffer = torch.empty(counts + (stored_shape[-1],), dtype=self.target.dtype)
        return first + (0,), counts + (stored_shape[-1],)

    def destination(self) -> torch.Tensor:
        return self.buffer if self.buffer is not None else self.target

    def finish(self) -> None:
        """Move block-buffer values into the target (no-op for plain reads)."""
        if self.buffer is None:
            return
        n = len(self.block)
        counts = self.buffer.shape[:-1]
        blocks = self.buffer.reshape(*counts, *self.block)
        order = [d for i in range(n) for d in (i, n + i)]
        dense = blocks.permute(order).reshape([c * b for c, b in zip(counts, self.block)])
        start = [o - f * b for o, f, b in zip(self.offsets, self.first_block, self.block)]
        region = dense[tuple(slice(s, s + t) for s, t in zip(start, self.target.shape))]
        self.target.copy_(region)
        self.buffer = None


class CheckpointReadError(CheckpointingException, CheckpointException):
    """The load request does not fit the checkpoint (a key or region it lacks, another global
    shape): ours and torch's ``CheckpointException``, as Megatron-Core's DCP load raises."""

    def __init__(self, message: str, failures: Optional[dict] = None):
        CheckpointingException.__init__(self, message)
        self._failures = dict(failures or {})


class RequestLoadPlanner(DefaultLoadPlanner):
    """Reads the requested tensor regions and objects from a ``torch_dist`` checkpoint.

    Args:
        tensors: the tensor requests; requests of one key with equal offsets share reads.
        object_keys: unique keys of the objects to read.
        shape_checked: global shape each key must have in the checkpoint (keys whose
            ShardedTensors allow a shape mismatch are absent: only their overlap is read).
        load_object: deserializes a bytes item (the allowlisting loader).
    """

    def __init__(self, tensors: List[TensorRequest], object_keys: Sequence[str],
                 shape_checked: Dict[str, Tuple[int, ...]], load_object):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.requests = tensors
        self.object_keys = list(object_keys)
        self.shape_checked = shape_checked
        self.load_object = load_object
        self.loaded_objects: Dict[str, Any] = {}
        self._primary: Dict[tuple, TensorRequest] = {}
        self._targets: Dict[str, List[TensorRequest]] = {}

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        mcore_data = getattr(self.metadata, "mcore_data", None) or {}
        self._primary, self._targets = {}, {}
        by_key: Dict[str, List[TensorRequest]] = {}
        for req in self.requests:
            ident = (req.key, req.offsets, tuple(req.target.shape))
            if ident in self._primary:
                continue
            self._primary[ident] = req
            by_key.setdefault(req.key, []).append(req)
        items: List[ReadItem] = []
        for key, reqs in by_key.items():
            items += self._plan_key(key, reqs, md.get(key), mcore_data.get(key) or {})
        for key in self.object_keys:
            if key not in md or hasattr(md[key], "chunks"):
                raise CheckpointingException(f"Object shard {key} not found in the checkpoint")
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        self.plan = LoadPlan(items)
        return self.plan

    def _plan_key(self, key: str, reqs: List[TensorRequest], stored, extra: dict) -> List[ReadItem]:
        if stored is None:
            raise CheckpointingException(
                f"{key} from model not in state dict: {sorted(self.metadata.state_dict_metadata)}")
        if not hasattr(stored, "chunks"):
            raise CheckpointingException(f"{key} is stored as an object, not a tensor")
        orig = extra.get("nd_reformulated_orig_global_shape")
        shape = tuple(orig) if orig is not None else tuple(stored.size)
        expected = self.shape_checked.get(key)
        if expected is not None and tuple(expected) != shape:
            raise CheckpointingException(
                f"Global shape mismatch for loaded ({torch.Size(shape)}) and expected "
                f"({tuple(expected)}) tensor for key {key}")
        chunks = []
        for req in reqs:
            offsets, sizes = req.read_box(stored.size, orig)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        items = create_read_items_for_chunk_list(key, stored, chunks)
        if expected is not None:
            covered = [0] * len(chunks)
            for item in items:
                covered[item.dest_index.index] += math.prod(item.lengths)
            for chunk, vol in zip(chunks, covered):
                if vol != math.prod(chunk.sizes):
                    raise CheckpointingException(
                        f"Saved chunks of {key} do not cover the requested region "
                        f"{tuple(chunk.offsets)} + {tuple(chunk.sizes)}")
        self._targets[key] = reqs
        return items

    def check(self, metadata: Metadata) -> None:
        """Plan once against ``metadata`` so request errors surface as CheckpointingException
        (inside ``dcp.load`` they would come wrapped in DCP's CheckpointException)."""
        self.set_up_planner({}, metadata, True)
        try:
            self.create_local_plan()
        except CheckpointingException as e:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            raise CheckpointReadError(str(e), {rank: _wrap_exception(e)}) from e

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = self.load_object(value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        req = self._targets[read_item.dest_index.fqn][read_item.dest_index.index]
        dest = req.destination()
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # the reader copied straight into the narrowed destination

    def finish_requests(self) -> None:
        """Rearrange reformulated reads and copy shared reads to duplicate requests."""
        for req in self._primary.values():
            req.finish()
        for req in self.requests:
            src = self._primary[(req.key, req.offsets, tuple(req.target.shape))]
            if src is not req:
                req.target.copy_(src.target)


# Earlier names, kept for existing callers. Not Megatron-Core's MCoreSavePlanner/MCoreLoadPlanner
# (different arguments): those are in ._mcore_planners.
McoreSavePlanner = TableSavePlanner
McoreLoadPlanner = RequestLoadPlanner
SafeFileSystemReader = CachedMetadataFileSystemReader
