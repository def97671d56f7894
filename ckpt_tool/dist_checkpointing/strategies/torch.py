"""The ``torch_dist`` backend: Megatron-Core checkpoints in PyTorch DCP format.

Built on :mod:`torch.distributed.checkpoint` (its file format, read planning and I/O). Saves
write the DCP items of :mod:`._dcp_planner`; loads go, as Megatron-Core's, through
``MCoreLoadPlanner`` on the PyT state dict of :mod:`._load_requests`. Checkpoints written
here load in Megatron-Core and vice versa; loads read only the requested local regions, so a
checkpoint can be loaded at another parallel layout.

Megatron-Core's building blocks are here too, for code written against them:
``mcore_to_pyt_state_dict`` (ShardedTensors as DCP-checkpointable values),
``MCoreSavePlanner``/``MCoreLoadPlanner`` (plain ``torch.distributed.checkpoint`` save/load of
such state dicts), ``CachedMetadataFileSystemReader`` and the ``MCoreMetadata``/``MCoreSavePlan``
classes that Megatron-Core <= 0.15 pickled into ``.metadata``.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import List, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.utils import _wrap_exception

from ckpt_tool._torchrun import group_initialized
from ckpt_tool.formats.containers.dcp.dcp_metadata import mcore_classes

from .._mcore_names import (  # noqa: F401 (re-exported as in MCore)
    HAVE_DTENSOR,
    HAVE_TE,
    MSC_PREFIX,
    MultiStorageClientFeature,
    get_torch_version,
    is_torch_min_version,
)
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, nested_values
from ..mapping import (  # noqa: F401 (is_main_replica: importable from here as in MCore)
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from ._dcp_planner import TableSavePlanner, WriteTable, check_not_flattened
from ._load_requests import CheckpointReadError, LoadRequests
from ._mcore_planners import MCoreLoadPlanner, MCoreSavePlanner
from ._pyt_state_dict import (  # the private ones: MCore's names, for code that imports them
    _get_filesystem_reader,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from .async_utils import AsyncRequest
from .base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from .cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from .checkpointable import CheckpointableShardedTensor, LocalShardsContainer
from .filesystem_async import FileSystemWriterAsync
from .state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan

__all__ = [
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "register_default_torch_strategies",
    "MCoreSavePlanner",
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "CachedMetadataFileSystemReader",
    "CheckpointableShardedTensor",
    "LocalShardsContainer",
    "flatten_state_dict",
    "mcore_to_pyt_state_dict",
    "sharded_tensor_to_torch_sharded_tensor",
    "ShardedBase",  # importable from here as in Megatron-Core
]

logger = logging.getLogger(__name__)

# What Megatron-Core <= 0.15 pickled into .metadata (a DCP Metadata / SavePlan with
# ``mcore_data``); reading such a file gives instances of these (see formats.containers.dcp.dcp_metadata).
_STAND_INS = {cls.__name__: cls for cls in mcore_classes().values()}
MCoreMetadata = _STAND_INS["MCoreMetadata"]
MCoreSavePlan = _STAND_INS["MCoreSavePlan"]

_METADATA_FNAME = ".metadata"


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects in PyTorch DCP format (``torch_dist``).

    Args:
        backend: format name recorded in ``metadata.json`` (``"torch_dist"``).
        version: format version (1).
        keep_only_main_replica: write only main replicas (``replica_id`` 0); recommended.
        thread_count: writer threads, and so data files per rank (``__{rank}_{i}.distcp``).
        cached_metadata: async saves reuse the previous save plan and global metadata when
            every rank's local plan is unchanged (planning then exchanges one integer), and
            the metadata of a loaded checkpoint put in ``cached_global_metadata`` when every
            rank's plan is the one stored in it (no plan then crosses ranks).
        separation_hint: keys starting with it go to files of their own
            (``{separation_hint}__{rank}_{i}.distcp``, ``thread_count // 2`` per group; needs
            ``thread_count >= 2``), as Megatron-Core does for e.g. optimizer state.
    """

    def __init__(self, backend: str, version: int, keep_only_main_replica: bool = True,
                 thread_count: int = 2, cached_metadata: bool = False,
                 separation_hint: str = None):
        super().__init__(backend, version)
        if separation_hint is not None and thread_count < 2:
            raise CheckpointingException(
                "thread_count must be at least 2 if separation_hint is provided")
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.use_cached_ckpt_structure = cached_metadata
        self.separation_hint = separation_hint
        # False: host tensors are written from where they are (the caller keeps them unchanged
        # until the write ends, e.g. they are staged already); device tensors are always staged
        self.stage_host_tensors = True
        # plan cache of async saves (the global metadata is only held by the coordinator)
        self.cached_central_plan = None
        self.cached_local_plan = None
        self.cached_global_metadata = None
        self.validated_cache_reuse = False
        self.validated_loaded_metadata_reuse = False
        self._plan_metadata = None  # the coordinator's metadata of the cached plan

    def save(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> None:
        """Synchronous save: :meth:`async_save`'s request run in this process, as
        Megatron-Core does (same writer, same files, write failures raised as
        ``CheckpointWriteError``), except that host tensors are written from where they are
        (no staging copy: nothing changes them before this returns)."""
        stage, self.stage_host_tensors = self.stage_host_tensors, False
        try:
            request = self.async_save(sharded_state_dict, checkpoint_dir)
        finally:
            self.stage_host_tensors = stage
        request.execute_sync()

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Plan the save and stage a private host copy of the data (call on every rank).

        Returns the request whose ``async_fn`` writes the staged data (in a background
        process when scheduled on an :class:`AsyncCallsQueue`) and whose finalize function
        gathers the write results and writes ``.metadata`` on the coordinator, raising on
        every rank if any rank failed. Live tensors may change as soon as this returns.
        With ``cached_metadata`` a save of an unchanged structure reuses the previous plan.
        """
        table = WriteTable.of(sharded_state_dict, self.keep_only_main_replica)
        writer = FileSystemWriterAsync(str(checkpoint_dir), thread_count=self.thread_count,
                                       overwrite=True, separation_hint=self.separation_hint)
        writer.stage_host_tensors = self.stage_host_tensors
        cached, loaded_plans = None, None
        if self.use_cached_ckpt_structure:
            # a loaded checkpoint's metadata (Megatron-LM passes the load strategy's)
            if self.cached_global_metadata is not self._plan_metadata:  # not our own (coordinator)
                loaded_plans = getattr(self.cached_global_metadata, "all_local_plans", None)
            if self.cached_central_plan is not None:
                cached = (self.cached_central_plan, self.cached_local_plan,
                          self.validated_cache_reuse)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            (ret, central_plan, local_plan, self.validated_cache_reuse,
             self.validated_loaded_metadata_reuse) = save_state_dict_async_plan(
                {}, writer, None, 0, planner=TableSavePlanner(table),
                cached_ckpt_structure=cached, loaded_all_plans=loaded_plans)
        writer, global_metadata, dist_wrapper = ret
        if self.use_cached_ckpt_structure:
            # as in MCore: a loaded checkpoint's metadata that fits is used as it is; once a
            # plan is validated, cached_global_metadata holds its metadata for the reuses
            if (loaded_plans and self.cached_global_metadata is not None
                    and self.validated_loaded_metadata_reuse):
                global_metadata = self.cached_global_metadata
            elif self.validated_cache_reuse:
                if global_metadata is not None:  # planned afresh, equal to the cached plan
                    self.cached_global_metadata = self._plan_metadata = global_metadata
                elif dist_wrapper.is_coordinator:
                    global_metadata = self.cached_global_metadata
            self.cached_central_plan, self.cached_local_plan = central_plan, local_plan
            if dist_wrapper.is_coordinator:
                global_metadata = copy.copy(global_metadata)
        return self._get_save_and_finalize_callbacks(
            writer, (writer, global_metadata, dist_wrapper))

    @staticmethod
    def _get_save_and_finalize_callbacks(writer: FileSystemWriterAsync,
                                         save_state_dict_ret) -> AsyncRequest:
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()

        def finalize_fn():
            save_state_dict_async_finalize(*save_state_dict_ret)

        return AsyncRequest(save_fn, tuple(save_args), [finalize_fn], preload_fn=preload_fn)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors and ShardedObjects from a ``torch_dist`` checkpoint.

    Each rank reads only the regions its ShardedTensors cover, from whichever saved chunks
    intersect them; tensors are loaded into the given ``data`` tensors when present.

    Args:
        trust: unpickle ``.metadata`` and objects without the allowlist (trusted sources only).
    """

    def __init__(self, trust: bool = False):
        super().__init__()
        self.trust = trust
        self.cached_global_metadata = None

    def load(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load the requested values; returns the same nested structure with plain values.

        As Megatron-Core: the request becomes a PyT state dict that
        ``torch.distributed.checkpoint`` loads with :class:`MCoreLoadPlanner` (its
        ``create_local_plan`` plans the reads). Request errors are raised before any read as
        ``CheckpointReadError`` (ours and torch's ``CheckpointException``); see
        :mod:`._load_requests` for shared reads and N-D reformulated tensors.
        """
        sharded_tensors: List[ShardedTensor] = []
        object_keys: List[str] = []
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedObject):
                object_keys.append(sh.unique_key)
                continue
            if not isinstance(sh, ShardedTensor):
                raise CheckpointingException(f"Cannot load {type(sh).__name__} {sh}")
            check_not_flattened(sh)
            if sh.data is None:
                sh.init_data("cpu", init_fn=torch.zeros if sh.allow_shape_mismatch
                             else torch.empty)
            else:
                if sh.data.requires_grad:  # as MCore: the loaded value is the detached tensor
                    sh.data = sh.data.detach()  # (its storage), so a parameter can be zeroed
                if sh.allow_shape_mismatch:
                    sh.data.zero_()
            sharded_tensors.append(sh)

        reader = CachedMetadataFileSystemReader(str(checkpoint_dir), trust=self.trust)
        metadata = reader.read_metadata()
        requests = LoadRequests(sharded_tensors, object_keys, metadata)
        try:
            requests.check()
        except CheckpointingException as e:
            rank = torch.distributed.get_rank() if group_initialized() else 0
            raise CheckpointReadError(str(e), {rank: _wrap_exception(e)}) from e
        pyt_state_dict = requests.pyt_state_dict()
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=requests.shapes_validation_sharded_tensors,
            allow_shape_mismatch_sharded_tensors=requests.allow_shape_mismatch_sharded_tensors,
            trust=self.trust)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(pyt_state_dict, storage_reader=reader, planner=planner,
                     no_dist=not group_initialized())
        requests.finish()
        self.cached_global_metadata = metadata

        def result(sh):
            if isinstance(sh, ShardedObject):
                values = pyt_state_dict[sh.unique_key]
                return values[0] if isinstance(values, list) and values else values
            return sh.data

        return dict_list_map_outplace(result, sharded_state_dict)

    def _read_metadata(self, checkpoint_dir: Union[str, Path]):
        reader = CachedMetadataFileSystemReader(str(checkpoint_dir), trust=self.trust)
        return reader.read_metadata()

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path], metadata=None):
        """Every saved tensor as a data-less ShardedTensor (global shape, dtype, meta device).

        Tensors that Megatron-Core <= 0.15 stored N-D reformulated get their original shape.
        """
        if metadata is None:
            metadata = self._read_metadata(checkpoint_dir)
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            orig = (mcore_data.get(key) or {}).get("nd_reformulated_orig_global_shape")
            shape = tuple(orig) if orig is not None else tuple(md.size)
            empty = torch.empty(shape, dtype=md.properties.dtype, device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]) -> ShardedStateDict:
        """Tensors as in :meth:`load_tensors_metadata` plus ShardedObjects by unique key."""
        metadata = self._read_metadata(checkpoint_dir)
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                out[obj.unique_key] = obj
        out.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return out

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str):
        """Drop tensors whose key starts with ``key_prefix`` and the data files named so.

        Like Megatron-Core, only files whose *name* starts with the prefix (written with a
        separation hint) are deleted; ``.metadata`` is rewritten atomically first.
        """
        checkpoint_dir = Path(checkpoint_dir)
        files = [f for f in os.listdir(checkpoint_dir)
                 if f.endswith(".distcp") and f.startswith(key_prefix)]
        if not files:
            warnings.warn(f'There are no files in {checkpoint_dir} that begin with '
                          f'"{key_prefix}". Skipping removal.')
            return
        md = self._read_metadata(checkpoint_dir)
        md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items()
                                  if not k.startswith(key_prefix)}
        if md.planner_data:
            md.planner_data = {k: v for k, v in md.planner_data.items()
                               if not k.startswith(key_prefix)}
        md.storage_data = {k: v for k, v in (md.storage_data or {}).items()
                           if not k.fqn.startswith(key_prefix)}
        tmp = checkpoint_dir / f"{_METADATA_FNAME}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, checkpoint_dir / _METADATA_FNAME)
        for f in files:
            os.remove(checkpoint_dir / f)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_version):
        pass

    def check_version_compatibility(self, loaded_version):
        pass


def register_default_torch_strategies() -> None:
    """Register ``torch_dist`` version 1 load and save defaults."""
    register_default_strategy(
        StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(
        StrategyAction.SAVE_SHARDED, "torch_dist", 1,
        TorchDistSaveShardedStrategy("torch_dist", 1))


register_default_torch_strategies()
