"""Megatron-Core's DCP planners for PyT state dicts (see :mod:`._pyt_state_dict`).

Public names are re-exported by :mod:`.torch`. Our own ``torch_dist`` strategy loads with
:class:`MCoreLoadPlanner` (see :mod:`._load_requests`) and saves with the planner of
:mod:`._dcp_planner`, which writes the same items as :class:`MCoreSavePlanner`.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from ..core import CheckpointingException
from ..mapping import ShardedTensor
from ..utils import _is_quantized_fp8

__all__ = ["MCoreSavePlanner", "MCoreLoadPlanner"]


class MCoreSavePlanner(DefaultSavePlanner):
    """DCP's save planner for a PyT state dict: every rank writes all its items.

    ShardedObjects are per-rank values (not replicated on every rank as DCP assumes for bytes)
    already serialized to ``BytesIO``, so they are written as they are; tensors are already
    deduplicated by replica id.

    Args:
        args, kwargs: DefaultSavePlanner's (Megatron-Core passes ``flatten_state_dict=False``).
        dedup_replicated_tensors: ignored by torch >= 2.3; must not be true with a
            decentralized plan.
        can_run_decentralized_global_plan: each rank may turn its local plan into its global
            plan itself (:meth:`create_decentralized_global_plan`); requires
            ``flatten_state_dict=False``.

    Raises ValueError for a decentralized plan with deduplication or flattening.
    """

    def __init__(self, *args, dedup_replicated_tensors: Optional[bool] = None,
                 can_run_decentralized_global_plan: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        if can_run_decentralized_global_plan:
            if dedup_replicated_tensors:
                raise ValueError(
                    "Cannot run decentralized plan with dedup_replicated_tensors=True")
            if self.flatten_state_dict:
                raise ValueError("Cannot run decentralized plan with flatten_state_dict=True")

    def create_local_plan(self) -> SavePlan:
        """Write items for every value of the state dict, on every rank."""
        items = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, DTensor):
                raise CheckpointingException(f"{fqn}: DTensors are not expected here")
            items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items=items, planner_data=self.mappings)
        return self.plan

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The local plan is already what the coordinator would make of it: return it."""
        if self.flatten_state_dict:
            raise ValueError("Cannot run decentralized plan with flatten_state_dict=True")
        if local_plan.planner_data:
            raise ValueError("Planner data should be empty with decentralized plan")
        return local_plan

    def transform_object(self, write_item: WriteItem, object: Any):
        """Objects are ``BytesIO`` already: written unchanged."""
        return object


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner plus global shape checks, for a PyT state dict.

    Args:
        args, kwargs: DefaultLoadPlanner's.
        shapes_validation_sharded_tensors: ShardedTensors whose key must be in the checkpoint
            with exactly their global shape (KeyError when missing, CheckpointingException
            when the shape differs).
        allow_shape_mismatch_sharded_tensors: key -> ShardedTensor whose stored global shape
            may differ; their requested chunks are planned against the expected shape.
        trust: unpickle ShardedObject bytes without the allowlist (trusted sources only).
    """

    def __init__(self, *args,
                 shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
                 allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
                 trust: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors
        self.trust = trust
        self._intermediate_read_item_and_target: Optional[Tuple[ReadItem, torch.Tensor]] = None

    @staticmethod
    def _validate_global_shapes(metadata: Metadata, sharded_tensors: Iterable[ShardedTensor]):
        stored = metadata.state_dict_metadata
        for sh_ten in sharded_tensors:
            if sh_ten.key not in stored:
                raise KeyError(f"{sh_ten.key} from model not in state dict: {sorted(stored)}")
            loaded_shape = stored[sh_ten.key].size
            if loaded_shape != sh_ten.global_shape:
                raise CheckpointingException(
                    f"Global shape mismatch for loaded ({loaded_shape}) and expected "
                    f"({sh_ten.global_shape}) tensor for key {sh_ten.key}")

    @contextmanager
    def _temporarily_bypass_shape_validation(self):
        """Pretend the stored size of shape-mismatch tensors is the expected one (DCP would
        refuse the plan otherwise); the metadata is restored afterwards."""
        if not self.allow_shape_mismatch_sharded_tensors:
            yield
            return
        stored = self.metadata.state_dict_metadata
        saved = [(stored[key], stored[key].size, sh_ten)
                 for key, sh_ten in self.allow_shape_mismatch_sharded_tensors.items()]
        try:
            for md, _, sh_ten in saved:
                md.size = torch.Size(sh_ten.global_shape)
            yield
        finally:
            for md, size, _ in saved:
                md.size = size

    def create_local_plan(self) -> LoadPlan:
        """DCP's plan, after checking the global shapes."""
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Deserialize a ShardedObject payload through the allowlisting unpickler."""
        from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

        loaded = load_torch_file(value, trust=self.trust)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def resolve_tensor(self, read_item: ReadItem):
        """DCP's target, except a non-contiguous FP8 target is swapped for a contiguous one
        (the reader copies into it) and restored by :meth:`commit_tensor`."""
        target = super().resolve_tensor(read_item)
        if (not target.is_contiguous() and _is_quantized_fp8(target)
                and hasattr(target, "make_like")):
            self._intermediate_read_item_and_target = (read_item, target)
            target = type(target).make_like(target, data=target._data.contiguous())
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy into the original target swapped out by :meth:`resolve_tensor`, if any."""
        if self._intermediate_read_item_and_target is not None:
            pending_item, target = self._intermediate_read_item_and_target
            if pending_item is not read_item:
                raise CheckpointingException(
                    "`commit_tensor` must be called right after `resolve_tensor`")
            target.copy_(tensor)
            tensor = target
            self._intermediate_read_item_and_target = None
        return super().commit_tensor(read_item, tensor)
