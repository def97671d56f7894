"""Checks around save and load: sharding integrity across ranks and strict-load handling.

Same names and behaviour as Megatron-Core's ``dist_checkpointing.validation``. Everything works
without a process group (a single process is then "all ranks"); with one, metadata is
exchanged with ``torch.distributed`` object collectives on the default group.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import List, Optional, Set, Tuple, Union

import torch

from ckpt_tool._torchrun import group_initialized
from ._mcore_names import MultiStorageClientFeature  # noqa: F401 (re-exported as in MCore)
from ._integrity import check_object_shards, check_tensor_shards, group_by_key
from ckpt_tool.storage import as_path
from .core import CheckpointingException, maybe_load_config
from .dict_utils import diff, extract_matching_values, nested_values
from .mapping import (
    CommonStateDict,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)

__all__ = [
    "StrictHandling",
    "parse_strict_flag",
    "validate_integrity_and_strict_load",
    "verify_checkpoint_and_load_strategy",
    "adjust_non_strict_load",
    "maybe_report_missing_and_unexpected_keys",
    "validate_sharding_integrity",
    "validate_objects_sharding_integrity",
    "determine_global_metadata",
    "validate_sharded_objects_handling",
    # imported names that Megatron-Core's module offers too
    "is_main_replica",
    "get_default_strategy",
    "StrategyAction",
]

logger = logging.getLogger(__name__)

# The sharded values (without data) one rank saves/loads, and that list for every rank.
_LocalMetadata = List[Union[ShardedTensor, ShardedObject]]
_GlobalMetadata = List[_LocalMetadata]


class StrictHandling(Enum):
    """What ``load`` does about keys that differ between the request and the checkpoint.

    "Unexpected" keys are requested but absent from the checkpoint; each rank can find them
    alone. "Missing" keys are in the checkpoint but requested by no rank; finding them needs
    the requests of all ranks (a metadata exchange), which only the ``*_ALL`` options do.
    Every option except ``ASSUME_OK_UNEXPECTED`` reads the checkpoint metadata before loading.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # leave it to the load strategy to fail
    LOG_UNEXPECTED = "log_unexpected"  # warn about unexpected keys (default non-strict)
    LOG_ALL = "log_all"  # warn about unexpected and missing keys
    RAISE_UNEXPECTED = "raise_unexpected"  # raise on unexpected keys before loading
    RAISE_ALL = "raise_all"  # raise on any mismatch
    RETURN_UNEXPECTED = "return_unexpected"  # load() also returns the unexpected keys
    RETURN_ALL = "return_all"  # load() also returns missing and unexpected keys
    IGNORE_ALL = "ignore_all"  # drop unexpected keys silently

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether ``val`` compares the request with the checkpoint metadata."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether ``val`` needs the requests of all ranks (to find missing keys)."""
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether ``load`` returns the mismatched keys in addition to the state dict."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Turn a flag value such as ``"log_all"`` into :class:`StrictHandling` (ValueError if bad)."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError) as e:
        raise ValueError(f"Invalid strict flag: {e}") from e


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[_LocalMetadata] = None,
    global_metadata: Optional[_GlobalMetadata] = None,
    ckpt_sharded_metadata: Optional[dict] = None,
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Apply ``strict`` to a load request and optionally validate its sharding.

    Args:
        sharded_state_dict: what this rank asks to load.
        strict: how to treat mismatches with the checkpoint (see :class:`StrictHandling`).
        validate_access_integrity: also check that the requests of all ranks form a valid
            sharding (needs ``global_metadata``).
        local_metadata: this rank's sharded values without data; derived if None.
        global_metadata: every rank's ``local_metadata``; without it no key is "missing".
        ckpt_sharded_metadata: ``{key: sharded value}`` read from the checkpoint; required
            by every ``strict`` except ``ASSUME_OK_UNEXPECTED``.

    Returns:
        ``(state dict without unexpected keys, missing keys, unexpected keys)``. Missing keys
        are the same on every rank; unexpected ones are per rank.
    """
    missing_keys: Set[str] = set()
    unexpected_keys: Set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException(
                "Cannot verify checkpoint mismatch with ckpt_sharded_metadata=None."
            )
        if local_metadata is None:
            local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict)]
        wants_missing = StrictHandling.requires_global_app_metadata(strict)
        missing_keys, unexpected_keys = _determine_missing_and_unexpected_keys(
            ckpt_sharded_metadata, local_metadata, global_metadata if wants_missing else None
        )
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected_keys)

        if strict == StrictHandling.IGNORE_ALL:
            missing_keys, unexpected_keys = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            maybe_report_missing_and_unexpected_keys(missing_keys, unexpected_keys, False)

    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException(
                "Cannot check sharding integrity without global_metadata (None)."
            )
        validate_sharding_integrity(global_metadata)

    return sharded_state_dict, missing_keys, unexpected_keys


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: str,
    sharded_strategy: Union["LoadShardedStrategy", Tuple[str, int], None] = None,
    common_strategy: Union["LoadCommonStrategy", Tuple[str, int], None] = None,
) -> Tuple["LoadShardedStrategy", "LoadCommonStrategy"]:
    """Check that ``checkpoint_dir`` is a distributed checkpoint and pick its load strategies.

    A strategy given as None is the default one for the backend recorded in
    ``metadata.json``; a ``(backend, version)`` tuple selects that default explicitly. The
    chosen strategies must accept the checkpoint's backends and versions.
    """
    if not as_path(checkpoint_dir).is_dir():  # (also an s3:// or msc:// prefix)
        raise CheckpointingException(f"Checkpoint directory {checkpoint_dir} does not exist")
    saved_config = maybe_load_config(checkpoint_dir)
    if saved_config is None:
        raise CheckpointingException(f"{checkpoint_dir} is not a distributed checkpoint")

    if sharded_strategy is None:
        sharded_strategy = (saved_config.sharded_backend, saved_config.sharded_backend_version)
    if isinstance(sharded_strategy, tuple):
        sharded_strategy = _default_load_strategy("LOAD_SHARDED", sharded_strategy)
    if common_strategy is None:
        common_strategy = (saved_config.common_backend, saved_config.common_backend_version)
    if isinstance(common_strategy, tuple):
        # (MCore 0.16.1 assigns this one to the sharded strategy by mistake.)
        common_strategy = _default_load_strategy("LOAD_COMMON", common_strategy)

    sharded_strategy.check_backend_compatibility(saved_config.sharded_backend)
    sharded_strategy.check_version_compatibility(saved_config.sharded_backend_version)
    common_strategy.check_backend_compatibility(saved_config.common_backend)
    common_strategy.check_version_compatibility(saved_config.common_backend_version)
    return sharded_strategy, common_strategy


def _default_load_strategy(action_name: str, backend_and_version: Tuple[str, int]):
    return get_default_strategy(getattr(StrategyAction, action_name), *backend_and_version)


def adjust_non_strict_load(
    sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: Set[str]
) -> ShardedStateDict:
    """A copy of the state dict without the sharded values whose key is in the given set."""

    def should_drop(x) -> bool:
        assert isinstance(x, ShardedBase), f"Unexpected type {type(x)}"
        return x.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, should_drop)
    return kept


def _determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: dict,
    local_metadata: _LocalMetadata,
    global_metadata: Optional[_GlobalMetadata] = None,
) -> Tuple[Set[str], Set[str]]:
    # unexpected: requested here but not stored; missing: stored but requested by no rank
    # (only computable from global_metadata, else reported as none).
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    unexpected_keys = {sh.key for sh in local_metadata} - ckpt_keys
    missing_keys: Set[str] = set()
    if global_metadata is not None:
        requested = {sh.key for rank_meta in global_metadata for sh in rank_meta}
        missing_keys = ckpt_keys - requested
    if missing_keys:
        logger.debug(f"Dist ckpt load missing keys: {missing_keys}")
    if unexpected_keys:
        logger.debug(f"Dist ckpt load unexpected keys: {unexpected_keys}")
    return missing_keys, unexpected_keys


def maybe_report_missing_and_unexpected_keys(
    missing_keys: Set[str], unexpected_keys: Set[str], raise_error: bool = True
) -> None:
    """Raise CheckpointingException (or log a warning) if any key mismatched."""
    if not missing_keys and not unexpected_keys:
        return
    titles, bodies = [], []
    if missing_keys:
        titles.append(
            "Some keys found in the checkpoint are missing in the provided sharded state dict. "
        )
        bodies.append(f"Missing keys (for all ranks): {missing_keys}. ")
    if unexpected_keys:
        titles.append(
            "Unexpected keys (not found in the checkpoint) encountered in the provided "
            "sharded state dict. "
        )
        bodies.append(f"Unexpected keys (for this rank): {unexpected_keys}. ")
    message = "".join(titles) + "\n" + "".join(bodies)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def _validate_common_state_dict(common_state_dict: CommonStateDict) -> None:
    """Warn on every rank whose common (non-sharded) state differs from rank 0's.

    Only rank 0 saves the common state, so a difference means another rank's values are lost.
    A no-op without a process group.
    """
    if not group_initialized():
        return
    rank = torch.distributed.get_rank()
    holder = [common_state_dict if rank == 0 else None]
    torch.distributed.broadcast_object_list(holder, src=0)
    if rank == 0:
        return
    only_rank0, only_here, mismatch = diff(holder[0], common_state_dict)
    if only_rank0 or only_here or mismatch:
        logger.warning(
            f"Rank {rank} common state dict differs from rank 0 common state dict. "
            f"Keys only on rank 0: {only_rank0}, "
            f"Keys only on {rank}: {only_here}, "
            f"Mismatched keys: {mismatch}"
        )


def validate_sharding_integrity(
    global_metadata: _GlobalMetadata, common_state_dict: Optional[CommonStateDict] = None
) -> None:
    """Check that the sharded values of all ranks describe a valid sharding.

    For every key, the main replicas must cover the global tensor exactly once (no gap, no
    overlap) and agree on dtype and global shape; every ShardedObject cell must be saved by
    exactly one main replica. With a process group only rank 0 checks (the others return);
    ``common_state_dict``, if given, is first compared across ranks (differences are logged).

    Args:
        global_metadata: per rank, its sharded values (e.g. from
            :func:`determine_global_metadata`).
        common_state_dict: the non-sharded part of the state dict of this rank.

    Raises:
        CheckpointingException: on an invalid sharding.
    """
    if common_state_dict is not None:
        _validate_common_state_dict(common_state_dict)
    if group_initialized() and torch.distributed.get_rank() != 0:
        return
    for key, entries in group_by_key(global_metadata).items():
        if all(isinstance(sh, ShardedObject) for _, sh in entries):
            _validate_objects_for_key(entries)
        elif all(isinstance(sh, ShardedTensor) for _, sh in entries):
            _validate_sharding_for_key(entries)
        else:
            kinds = sorted({type(sh).__name__ for _, sh in entries})
            raise CheckpointingException(f"Key {key!r} is used by different kinds: {kinds}")


def _validate_sharding_for_key(rank_sharding: List[Tuple[int, ShardedTensor]]) -> None:
    """One key's ShardedTensors of all ranks, as ``(rank, ShardedTensor)``: agree on dtype and
    global shape, main replicas cover the tensor exactly once (MCore's name; our checks)."""
    check_tensor_shards(rank_sharding[0][1].key, rank_sharding)


def _compute_shards_access(rank_sharding: List[Tuple[int, ShardedTensor]]) -> torch.Tensor:
    """How many main replicas hold each cell of the regular sharding grid (an int tensor of
    shape ``axis_fragmentations``; a valid sharding has 1 everywhere)."""
    counts = torch.zeros(tuple(rank_sharding[0][1].axis_fragmentations), dtype=torch.int)
    for _, sh_ten in rank_sharding:
        if is_main_replica(sh_ten.replica_id):
            counts[tuple(sh_ten.local_chunk_offset_in_global())] += 1
    return counts


def _validate_objects_for_key(sharded_objects: List[Tuple[int, ShardedObject]]) -> None:
    """One unique object key's ShardedObjects of all ranks, as ``(rank, ShardedObject)``: each
    cell saved by exactly one main replica (MCore's name; our checks)."""
    check_object_shards(sharded_objects[0][1].key, sharded_objects)


def validate_objects_sharding_integrity(global_metadata: _GlobalMetadata) -> None:
    """The ShardedObject part of :func:`validate_sharding_integrity` (tensors are ignored)."""
    if group_initialized() and torch.distributed.get_rank() != 0:
        return
    objects_only = [
        [sh for sh in rank_values if isinstance(sh, ShardedObject)]
        for rank_values in global_metadata
    ]
    for key, entries in group_by_key(objects_only).items():
        check_object_shards(key, entries)


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[_LocalMetadata, _GlobalMetadata]:
    """This rank's sharded values without data, and that list gathered from every rank.

    Without a process group the global metadata is ``[local_metadata]``.
    """
    local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict)]
    if not group_initialized():
        return local_metadata, [local_metadata]
    global_metadata = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(global_metadata, local_metadata)
    return local_metadata, global_metadata  # type: ignore[return-value]


def validate_sharded_objects_handling(
    sharded_strategy: Union["SaveShardedStrategy", "LoadShardedStrategy"],
    common_strategy: Union["SaveCommonStrategy", "LoadCommonStrategy"],
) -> None:
    """Raise CheckpointingException unless one of the strategies handles ShardedObjects."""
    if not (
        sharded_strategy.can_handle_sharded_objects or common_strategy.can_handle_sharded_objects
    ):
        raise CheckpointingException(
            f"Either sharded strategy or common strategy must implement ShardedObjects handling."
            f" Both {sharded_strategy} and {common_strategy} specify "
            f"can_handle_sharded_objects=False"
        )
