"""Fully-parallel save and load: spread the I/O of replicated shards over a process group.

Same names and semantics as Megatron-Core's ``strategies.fully_parallel``. Data-parallel ranks
hold replicas of the same shards, and normally only the main replica (on the first DP rank)
is written. :class:`FullyParallelSaveStrategyWrapper` instead picks, for every shard, one holder
in the parallelization group so that each rank writes about the same number of bytes (each shard
is still written exactly once). :class:`FullyParallelLoadStrategyWrapper` reads each shard on
one rank of the group and sends it to the others. The checkpoint format is the wrapped
strategy's: the result loads with any loader, including Megatron-Core's.

Typical use (on every rank)::

    base = get_default_save_sharded_strategy()
    save(sharded_sd, ckpt_dir, FullyParallelSaveStrategyWrapper(base, dp_group))
    load(sharded_sd, ckpt_dir,
         FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), dp_group))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar, Union

import torch
import torch.distributed as dist

from ckpt_tool._torchrun import group_initialized
from .._mcore_names import get_pg_rank, get_pg_size  # noqa: F401 (re-exported as in MCore)
from ..core import CheckpointingException
from ..dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from ..exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId, debug_time
from ..validation import determine_global_metadata, validate_sharding_integrity
from .async_utils import AsyncRequest
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy

__all__ = [
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "distribute_main_replicas_with_precomputed_distribution",
]

logger = logging.getLogger(__name__)

T = TypeVar("T", ShardedObject, ShardedTensor)


def _group_size(group) -> int:
    return dist.get_world_size(group=group) if group_initialized() else 1


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wraps a sharded save strategy and spreads the writing of replicas over a group.

    Only metadata is exchanged (no tensor data). For every ShardedTensor shard held in the
    group, the holder chosen by ``distribute_shards_to_ranks`` gets ``replica_id`` 0 and the
    other holders 1; the wrapped strategy then writes main replicas as usual. ShardedObjects
    are left alone.

    Args:
        strategy: the strategy that writes (it must save only main replicas).
        parallelization_group: the group sharing the writing, usually the DP group; the
            whole world by default.
        do_cache_distribution: reuse the distribution of the first call (only valid while
            the state dict structure does not change).
    """

    def __init__(self, strategy: SaveShardedStrategy,
                 parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False):
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        if parallelization_group is None:
            parallelization_group = dist.group.WORLD
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[ShardDistribution] = None

    def async_save(self, sharded_state_dict: ShardedStateDict,
                   checkpoint_dir: Union[str, Path]) -> AsyncRequest:
        """Apply the distribution, then the wrapped strategy's ``async_save``."""
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"Cannot apply async_save to non-async base strategy {self.base_strategy}")
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> None:
        """Apply the distribution, then the wrapped strategy's ``save``."""
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save(sharded_state_dict, checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Set ``replica_id`` of this rank's ShardedTensors to 0 (writes it) or 1 (does not).

        Collective over the group unless a cached distribution is reused. The first
        distribution is checked globally (each shard written exactly once).
        """
        with debug_time("apply_saving_parallelization", logger):
            if self.do_cache_distribution and self.cached_distribution is not None:
                distribution = self.cached_distribution
            else:
                distribution = determine_main_replica_uniform_distribution(
                    sharded_state_dict, self.parallelization_group)
            distribute_main_replicas_with_precomputed_distribution(
                sharded_state_dict, self.parallelization_group, distribution)
            if self.cached_distribution is None:
                validate_sharding_integrity(determine_global_metadata(sharded_state_dict)[1])
            if self.do_cache_distribution:
                self.cached_distribution = distribution

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Wraps a sharded load strategy: each shard is read by one rank and sent to the others.

    Args:
        strategy: the strategy that reads.
        parallelization_group: the group sharing the reading (usually the DP group); the
            whole world by default.
        do_cache_distribution: reuse the first load distribution (same structure only; a
            load distribution is not a valid save distribution).
        exchange_algo: ``broadcast`` (default: one broadcast per shard), ``gather_object``
            (one ``all_gather_object`` of everything; simple, for debugging) or
            ``gather_rounds`` (per dtype, rounds of ``all_gather``).
    """

    def __init__(self, strategy: LoadShardedStrategy,
                 parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast"):
        super().__init__()
        self.base_strategy = strategy
        if parallelization_group is None:
            parallelization_group = dist.GroupMember.WORLD
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: Optional[ShardDistribution] = None
        self.cached_global_metadata = None

    def load(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: Union[str, Path]) -> StateDict:
        """Load like the wrapped strategy would, reading each shard only once in the group.

        Collective over the group (and, for ShardedObjects, the world). Steps:
        1. exchange the ShardedTensor metadata and plan, identically on every rank, which
           rank reads which shard (balanced by bytes);
        2. read the ShardedObjects this rank holds main replicas of, then its planned shards;
        3. exchange the shards (``exchange_algo``) and the objects (``all_gather_object``).

        Returns the same nested structure with plain values, as the wrapped strategy does.
        """
        if _group_size(self.parallelization_group) <= 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)

        distribution = self.apply_loading_parallelization(sharded_state_dict)
        if distribution is None:
            raise CheckpointingException(
                "Expecting non-trivial distribution for non-trivial parallelization group")

        sharded_tensors, rest, to_load_shards, unloaded_shards = (
            self._defer_loading_sharded_tensors(sharded_state_dict))
        sharded_objects, rest, to_load_objects, unloaded_objects = (
            self._defer_loading_sharded_objects(rest))
        if any(True for _ in nested_values(rest)):
            raise CheckpointingException(
                f"Only ShardedTensors and ShardedObjects can be loaded, got: {rest}")

        with debug_time("base_load", logger):
            loaded_objects = self.base_strategy.load(to_load_objects, checkpoint_dir)
            loaded_tensors = self.base_strategy.load(to_load_shards, checkpoint_dir)

        with debug_time("exchange_loaded_tensors", logger):
            all_loaded_tensors = exchange_by_distribution(
                loaded_tensors, unloaded_shards, distribution, self.parallelization_group,
                self.exchange_algo)
        missing = set(unloaded_shards) - set(all_loaded_tensors)
        if missing:
            raise CheckpointingException(
                f"Missing shards after fully parallel loading: {missing}")

        all_loaded_objects = exchange_loaded_objects_gather_object(loaded_objects)
        missing = set(unloaded_objects) - set(all_loaded_objects)
        if missing:
            raise CheckpointingException(
                f"Missing object shards after fully parallel loading: {missing}")

        self.fill_in_deferred_sharded_tensors(sharded_tensors, all_loaded_tensors)
        self.fill_in_deferred_sharded_objects(sharded_objects, all_loaded_objects)
        loaded_state_dict: StateDict = {}
        merge(loaded_state_dict, sharded_objects)
        merge(loaded_state_dict, sharded_tensors)
        if hasattr(self.base_strategy, "cached_global_metadata"):
            self.cached_global_metadata = self.base_strategy.cached_global_metadata
        return loaded_state_dict

    @staticmethod
    def _defer_loading_sharded_objects(sharded_state_dict: ShardedStateDict):
        return _defer_loading_sharded_items(sharded_state_dict, ShardedObject,
                                            _sharded_object_id)

    @staticmethod
    def _defer_loading_sharded_tensors(sharded_state_dict: ShardedStateDict):
        return _defer_loading_sharded_items(sharded_state_dict, ShardedTensor,
                                            _sharded_tensor_shard_id)

    @staticmethod
    def fill_in_deferred_sharded_objects(sharded_state_dict: ShardedStateDict,
                                         loaded_objects: Dict[_ShardId, Any]) -> None:
        """Replace every ShardedObject by its value in ``loaded_objects`` (by shard id)."""
        _fill_in_deferred_sharded_items(sharded_state_dict, loaded_objects, ShardedObject,
                                        _sharded_object_id)

    @staticmethod
    def fill_in_deferred_sharded_tensors(sharded_state_dict: ShardedStateDict,
                                         loaded_tensors: Dict[_ShardId, torch.Tensor]) -> None:
        """Replace every ShardedTensor by its tensor in ``loaded_tensors`` (by shard id)."""
        _fill_in_deferred_sharded_items(sharded_state_dict, loaded_tensors, ShardedTensor,
                                        _sharded_tensor_shard_id)

    def apply_loading_parallelization(
            self, sharded_state_dict: ShardedStateDict) -> Optional[ShardDistribution]:
        """Plan the load over the group and mark this rank's shards with ``replica_id`` 0.

        Every shard needed in the group is planned, including those whose main replica lies
        outside it. Returns the distribution (None for a single-rank group).
        """
        if self.do_cache_distribution and self.cached_distribution is not None:
            distribution = self.cached_distribution
        else:
            distribution = determine_main_replica_uniform_distribution(
                sharded_state_dict, self.parallelization_group, True)
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution)
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        return distribution

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def load_tensors_metadata(self, checkpoint_dir: Union[str, Path]):
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Union[str, Path]):
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_version):
        return self.base_strategy.check_backend_compatibility(loaded_version)

    def check_version_compatibility(self, loaded_version):
        return self.base_strategy.check_version_compatibility(loaded_version)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Optional[dist.ProcessGroup],
    precomputed_distribution: Optional[ShardDistribution],
) -> None:
    """Apply a distribution from ``determine_main_replica_uniform_distribution``.

    This rank's ShardedTensors assigned to it get ``replica_id`` 0, all others 1. E.g. A, B, C
    replicated on ranks 0-2 become A: 0, B: 1, C: 1 on rank 0; A: 1, B: 0, C: 1 on rank 1; ...
    Nothing changes for a single-rank group.
    """
    if parallelization_group is None:
        parallelization_group = dist.group.WORLD
    if _group_size(parallelization_group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError(
            "precomputed_distribution must be not None for non-trivial parallelization group")
    rank = dist.get_rank(group=parallelization_group)
    for sh_ten in nested_values(sharded_state_dict):
        if not isinstance(sh_ten, ShardedTensor):
            continue
        shard_id = _sharded_tensor_shard_id(sh_ten)
        mine = (shard_id in precomputed_distribution.shards_in_this_group
                and precomputed_distribution.main_rank_for_shard[shard_id] == rank)
        sh_ten.replica_id = 0 if mine else 1


def _defer_loading_sharded_items(
    sharded_state_dict: ShardedStateDict, item_type: type, shard_id_func: Callable[[T], _ShardId]
) -> Tuple[ShardedStateDict, ShardedStateDict, Dict[_ShardId, T], Dict[_ShardId, T]]:
    """Split off the ``item_type`` values and sort them by who loads them.

    Returns (the ``item_type`` values, the rest, main replicas (loaded here) by shard id,
    other replicas (loaded elsewhere) by shard id).
    """
    to_load: Dict[_ShardId, T] = {}
    elsewhere: Dict[_ShardId, T] = {}
    items, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, item_type))
    for item in nested_values(items):
        target = to_load if is_main_replica(item.replica_id) else elsewhere
        target[shard_id_func(item)] = item
    return items, rest, to_load, elsewhere


def _fill_in_deferred_sharded_items(
    sharded_state_dict: ShardedStateDict,
    loaded_items: Dict[_ShardId, Any],
    item_type: type,
    shard_id_func: Callable[[T], _ShardId],
) -> None:
    def fill(x: Any) -> Any:
        if not isinstance(x, item_type):
            return x
        try:
            return loaded_items[shard_id_func(x)]
        except KeyError as e:
            raise CheckpointingException(f"Missing loaded item shard: {shard_id_func(x)}") from e

    dict_list_map_inplace(fill, sharded_state_dict)
