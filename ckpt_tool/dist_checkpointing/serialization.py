"""Entry points to save and load distributed checkpoints (Megatron-Core's ``serialization``).

``save``/``load`` work like ``torch.save``/``torch.load`` on state dicts whose tensors are
wrapped in :class:`ShardedTensor` / :class:`ShardedObject`: every rank passes its own local
shards, and ``load`` uses the given sharded state dict to decide which parts of the global
tensors this rank reads (so the parallel layout may differ from the one that saved).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Set, Tuple, Union

import torch

from ckpt_tool._pause_points import pause_point
from ckpt_tool._torchrun import group_initialized
from ckpt_tool.formats.mcore_dist.config import config_bytes
from ckpt_tool.storage import as_path, is_remote
from ckpt_tool.formats.mcore_dist.forms import COMMON_STATE_KEY

from ._manifest import remove_integrity_json, write_integrity_json
from ._mcore_names import MultiStorageClientFeature, log_single_rank  # noqa: F401 (re-exported as in MCore)
from .core import CheckpointingConfig, CheckpointingException, save_config
from .dict_utils import extract_matching_values, merge
from .mapping import (
    CommonStateDict,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factory_merges,
)
from .state_dict_utils import load_preprocess, save_preprocess
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from .utils import extract_sharded_base, force_all_tensors_to_non_fp8
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_sharded_objects_handling,
    verify_checkpoint_and_load_strategy,
)

__all__ = [
    "CkptShardedMetadata",
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "load_sharded_objects",
    "remove_sharded_tensors",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
]

logger = logging.getLogger(__name__)

# flat dict of data-less ShardedTensors/ShardedObjects, keyed by their (unique) keys
CkptShardedMetadata = Dict[str, Union[ShardedTensor, ShardedObject]]

_CONTENT_METADATA_KEY = "content_metadata"


def _rank() -> int:
    return torch.distributed.get_rank() if group_initialized() else 0


def _barrier() -> None:
    if group_initialized():
        torch.distributed.barrier()


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load a distributed checkpoint into the structure of ``sharded_state_dict``.

    The result starts from the checkpoint's common state dict; non-persistent values of the
    request are merged in, then every ShardedObject and ShardedTensor is replaced by its loaded
    value (tensors are loaded into their ``data`` when it is set) and factories are merged.

    Args:
        sharded_state_dict: this rank's request: what to load and where it sits globally.
        checkpoint_dir: the checkpoint directory.
        sharded_strategy: a load strategy, a ``(backend, version)`` default, or None for the
            backend recorded in ``metadata.json``.
        common_strategy: same, for the common part.
        validate_access_integrity: check that all ranks together read each main replica
            shard exactly once.
        strict: how to handle keys requested but absent from the checkpoint (and, for some
            values, keys present but not requested); see :class:`StrictHandling`.

    Returns:
        the loaded state dict, or ``(state_dict, missing_keys, unexpected_keys)`` when
        ``strict`` is one of the ``RETURN_*`` values.
    """
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy)
    force_all_tensors_to_non_fp8(sharded_state_dict)

    common_state_dict = common_strategy.load_common(checkpoint_dir)
    sharded_state_dict, nonpersistent_state_dict, factories = load_preprocess(sharded_state_dict)
    merge(common_state_dict, nonpersistent_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)

    strict = parse_strict_flag(strict)
    ckpt_sharded_metadata = None
    local_metadata = global_metadata = None
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        ckpt_sharded_metadata = load_sharded_metadata(
            checkpoint_dir, sharded_strategy, common_strategy)
        # Megatron-Core 0.19's common state is a ShardedObject, loaded above as the common
        # state: not a key any request is expected to ask for
        ckpt_sharded_metadata = {k: v for k, v in ckpt_sharded_metadata.items()
                                 if v.key != COMMON_STATE_KEY}
    if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
        local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
        sharded_state_dict, strict, validate_access_integrity, local_metadata,
        global_metadata, ckpt_sharded_metadata)

    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        objects_state_dict, sharded_state_dict = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, ShardedObject))
        merge(common_state_dict,
              common_strategy.load_sharded_objects(objects_state_dict, checkpoint_dir))

    loaded_state_dict = sharded_strategy.load(sharded_state_dict, checkpoint_dir)
    merge(common_state_dict, loaded_state_dict)
    common_state_dict = apply_factory_merges(common_state_dict, factories)

    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common_state_dict, missing_keys, unexpected_keys
    return common_state_dict


def load_common_state_dict(checkpoint_dir: Union[str, Path]) -> StateDict:
    """The common (non-sharded) state dict of a checkpoint: ``common.pt``, else (Megatron-Core
    0.19) the ``common_state`` object of its torch_dist data."""
    checkpoint_dir = str(checkpoint_dir)
    _, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    return common_strategy.load_common(checkpoint_dir)


def load_tensors_metadata(
    checkpoint_dir: str, sharded_strategy: Union[LoadShardedStrategy, None] = None
) -> CkptShardedMetadata:
    """Every tensor of a checkpoint as a data-less, unsharded ShardedTensor, by tensor key.

    Only key, dtype and global shape are meaningful. Tensors Megatron-Core <= 0.15 stored
    N-D reformulated (flattened optimizer state) are described by their original shape.
    """
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded_strategy.load_tensors_metadata(as_path(checkpoint_dir))


def load_sharded_metadata(
    checkpoint_dir: str,
    sharded_strategy: Union[LoadShardedStrategy, None] = None,
    common_strategy: Union[LoadCommonStrategy, None] = None,
) -> CkptShardedMetadata:
    """Like :func:`load_tensors_metadata`, plus ShardedObjects keyed by their unique keys.

    Objects come from the common strategy when the sharded one cannot store them.
    """
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(
        checkpoint_dir, sharded_strategy, common_strategy)
    sharded_metadata = sharded_strategy.load_sharded_metadata(checkpoint_dir)
    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        sharded_metadata = merge(sharded_metadata,
                                 common_strategy.load_sharded_metadata(checkpoint_dir))
    return sharded_metadata


def load_plain_tensors(checkpoint_dir: str) -> StateDict:
    """Every tensor of a checkpoint, whole and unsharded, keyed by tensor key.

    The common state dict is not included. Each rank reads whole tensors.
    """
    sharded_state_dict = load_tensors_metadata(checkpoint_dir)
    return load(sharded_state_dict, checkpoint_dir, validate_access_integrity=False)


def load_content_metadata(
    checkpoint_dir: Optional[str] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[dict]:
    """The ``content_metadata`` given to :func:`save`, or None if the checkpoint has none.

    Pass ``preloaded_state_dict`` (a loaded common state dict) to avoid reading it again.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ValueError("Both checkpoint_dir and loaded_state_dict cannot be None")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    return preloaded_state_dict.get(_CONTENT_METADATA_KEY)


def load_sharded_objects(
    sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: str
) -> StateDict:
    """Load only the ShardedObjects of ``sharded_objects_state_dict`` (same structure)."""
    sharded_strategy, common_strategy = verify_checkpoint_and_load_strategy(checkpoint_dir)
    objects, _ = extract_matching_values(
        sharded_objects_state_dict, lambda v: isinstance(v, ShardedObject))
    if sharded_strategy.can_handle_sharded_objects:
        return sharded_strategy.load(objects, checkpoint_dir)
    return common_strategy.load_sharded_objects(objects, checkpoint_dir)


def remove_sharded_tensors(checkpoint_dir: str, key_prefix: str) -> None:
    """Remove the tensors whose keys start with ``key_prefix`` (delegated to the backend)."""
    sharded_strategy, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    sharded_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[
        Callable[[CommonStateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict as a distributed checkpoint (call on every rank).

    Factories are applied and non-persistent values dropped; everything that is not sharded
    goes to the common file (rank 0); ShardedObjects and the main replicas of ShardedTensors
    go to the sharded backend. ``metadata.json``, which marks the checkpoint complete, is
    written last by rank 0 after all ranks finished, right after the integrity manifest
    ``integrity.json`` (sha256 and size of every file, ``metadata.json`` included).

    Args:
        sharded_state_dict: this rank's state dict with ShardedTensors/ShardedObjects.
        checkpoint_dir: the target directory (rank 0 creates it if needed; an old
            incomplete checkpoint in it is overwritten).
        sharded_strategy: a save strategy or a ``(backend, version)`` default
            (``torch_dist`` v1 by default).
        common_strategy: must be None (the ``torch`` common backend).
        validate_access_integrity: check the global sharding (each shard saved exactly once)
            and that the common state dict agrees across ranks.
        async_sharded_save: return an :class:`AsyncRequest` for the sharded part instead of
            saving it; ``metadata.json`` is then written by its last finalize function.
        preprocess_common_before_consistancy_check: maps the common state dict before the
            cross-rank consistency check (e.g. to drop keys expected to differ).
        content_metadata: stored as ``content_metadata`` in the common state dict.

    Returns:
        the AsyncRequest with ``async_sharded_save``, else None.
    """
    if is_remote(checkpoint_dir):  # s3:// or msc://: saved locally, then uploaded in order
        from ._remote_save import save_remote

        return save_remote(lambda spool: save(
            sharded_state_dict, spool, sharded_strategy, common_strategy,
            validate_access_integrity, async_sharded_save,
            preprocess_common_before_consistancy_check, content_metadata), str(checkpoint_dir))
    checkpoint_dir = str(checkpoint_dir)
    if _rank() == 0:
        if os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir):
            logger.warning("Overwriting old incomplete / corrupted checkpoint...")
        os.makedirs(checkpoint_dir, exist_ok=True)
        marker = os.path.join(checkpoint_dir, "metadata.json")
        if os.path.exists(marker):  # the old marker must not vouch for new, partial data
            os.remove(marker)
        remove_integrity_json(checkpoint_dir)

    if common_strategy is not None:
        raise NotImplementedError("The only supported common strategy is torch")
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif not isinstance(sharded_strategy, SaveShardedStrategy):
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    common_strategy = get_default_save_common_strategy()

    if content_metadata is not None:
        sharded_state_dict[_CONTENT_METADATA_KEY] = content_metadata
    sharded_state_dict, state_dict = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check)
    common_strategy.save_common(state_dict, checkpoint_dir)

    if not sharded_strategy.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded_strategy, common_strategy)
        objects_state_dict, sharded_state_dict = extract_matching_values(
            sharded_state_dict, lambda v: isinstance(v, ShardedObject))
        common_strategy.save_sharded_objects(objects_state_dict, checkpoint_dir)

    def write_metadata_json():
        _barrier()  # every rank finished its part
        pause_point("save-finalize")
        config = CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version)
        write_integrity_json(checkpoint_dir, config_bytes(config))  # (collective)
        if _rank() == 0:
            save_config(config, checkpoint_dir)
        _barrier()

    if not async_sharded_save:
        sharded_strategy.save(sharded_state_dict, checkpoint_dir)
        write_metadata_json()
        return None
    if not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(
            f"Cannot apply async_save to non-async strategy {sharded_strategy}")
    # stages a private copy of the data: the live tensors may change once this returns
    request = sharded_strategy.async_save(sharded_state_dict, checkpoint_dir)
    # runs after the sharded finalize, which raises on every rank if any write failed
    request.finalize_fns.append(write_metadata_json)
    return request


def get_default_save_sharded_strategy(backend: str = "torch_dist",
                                      version: int = 1) -> SaveShardedStrategy:
    """The default sharded save strategy of ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)


def get_default_save_common_strategy(backend: str = "torch",
                                     version: int = 1) -> SaveCommonStrategy:
    """The default common save strategy of ``(backend, version)``."""
    return get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str) -> LoadShardedStrategy:
    """The default sharded load strategy for the checkpoint in ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]
