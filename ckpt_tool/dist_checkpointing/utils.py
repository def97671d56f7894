"""Helpers for sharded state dicts: splitting them by value kind, renaming keys, debugging.

Same names and behaviour as Megatron-Core's ``dist_checkpointing.utils``.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)

__all__ = [
    "zip_strict",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "debug_time",
    "debug_msg",
]

# Identifies one stored piece of data: (key, global_offset, flattened (start, stop) or None).
# Replicas of the same piece on different ranks share it.
_ShardId = Tuple[str, tuple, Optional[tuple]]


def zip_strict(*args):
    """``zip`` that first checks all iterables have the same length (and names the lengths)."""
    materialized = [list(a) for a in args]
    lengths = [len(a) for a in materialized]
    assert len(set(lengths)) <= 1, f"Tried to zip iterables of unequal lengths: {lengths}!"
    return zip(*materialized)


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    rng = sharded_tensor.flattened_range
    return (
        sharded_tensor.key,
        sharded_tensor.global_offset,
        None if rng is None else (rng.start, rng.stop),
    )


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    return (sharded_object.key, sharded_object.global_offset, sharded_object.global_shape)


def _split_by_type(sharded_state_dict: ShardedStateDict, types: tuple):
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, types))


def extract_sharded_tensors(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensors, everything else), both keeping the nesting."""
    return _split_by_type(sharded_state_dict, (ShardedTensor,))


def extract_sharded_tensors_and_factories(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensors and ShardedTensorFactories, everything else)."""
    return _split_by_type(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return _split_by_type(
        sharded_state_dict, (ShardedTensor, LocalNonpersistentObject, ShardedTensorFactory)
    )


def extract_sharded_base(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (all sharded values: tensors, objects, factories; everything else)."""
    return _split_by_type(sharded_state_dict, (ShardedBase,))


def extract_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (LocalNonpersistentObjects, everything else)."""
    return _split_by_type(sharded_state_dict, (LocalNonpersistentObject,))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded value, in place."""

    def add_prefix(x):
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


_RENAMEABLE = (ShardedTensor, ShardedTensorFactory, ShardedObject)


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every sharded key, in place.

    Raises ValueError if some ShardedTensor/ShardedObject/factory key lacks ``old_prefix``.
    """

    def swap(x):
        if isinstance(x, _RENAMEABLE):
            if not x.key.startswith(old_prefix):
                raise ValueError(f"Expected {x.key} to begin with prefix {old_prefix}")
            x.key = new_prefix + x.key[len(old_prefix) :]
        return x

    dict_list_map_inplace(swap, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename sharded keys by the first matching ``old -> new`` prefix of ``prefix_map``.

    Keys matching no prefix are left alone. Modifies the state dict in place.
    """

    def swap(x):
        if isinstance(x, _RENAMEABLE):
            for old, new in prefix_map.items():
                if x.key.startswith(old):
                    x.key = new + x.key[len(old) :]
                    break
        return x

    dict_list_map_inplace(swap, sharded_state_dict)


def _is_quantized_fp8(t: Any) -> bool:
    # Transformer Engine's FP8 tensors (Float8Tensor in TE 1.x, QuantizedTensor subclasses in
    # TE 2.x). Checked by class name so that TE never has to be importable.
    names = {cls.__name__ for cls in type(t).__mro__}
    return bool(names & {"Float8Tensor", "QuantizedTensor"})


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace Transformer Engine FP8 ``data`` of sharded values by its dequantized tensor."""
    for v in nested_values(sharded_state_dict):
        data = getattr(v, "data", None)
        if data is not None and _is_quantized_fp8(data):
            v.data = data.dequantize() if hasattr(data, "dequantize") else data.from_float8()


fallback_logger = logging.getLogger(__name__)
_LOGGER_NAME_STACK: List[str] = []
_LOGGER_STACK: List[logging.Logger] = []


@contextmanager
def logger_stack(
    name: Optional[str] = None, current_logger: Optional[logging.Logger] = None
) -> Iterator[Tuple[str, logging.Logger]]:
    """Push a scope name and/or logger for nested timing/debug messages.

    Yields ``(dotted scope names, logger to use)``; the logger is ``current_logger``, else the
    innermost pushed one, else this module's logger.
    """
    if name:
        _LOGGER_NAME_STACK.append(name)
    if current_logger:
        _LOGGER_STACK.append(current_logger)
    active = current_logger or (_LOGGER_STACK[-1] if _LOGGER_STACK else fallback_logger)
    try:
        yield ".".join(_LOGGER_NAME_STACK), active
    finally:
        if name and _LOGGER_NAME_STACK:
            _LOGGER_NAME_STACK.pop()
        if current_logger and _LOGGER_STACK:
            _LOGGER_STACK.pop()


@contextmanager
def debug_time(
    name: str,
    logger: Optional[logging.Logger] = None,
    threshold: float = float("-inf"),
    level: Optional[int] = None,
):
    """Log how long the block took as ``"<scope> took <s>s"``.

    Nothing is logged below ``threshold`` seconds. The level defaults to DEBUG, or WARNING
    when a threshold is given.
    """
    with logger_stack(name, logger) as (scope, active):
        start = time.time()
        try:
            yield
        finally:
            elapsed = time.time() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                active.log(level, f"{scope} took {elapsed:.4f}s")


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG level, prefixed with the current :func:`logger_stack` scope."""
    with logger_stack(None, None) as (scope, active):
        active.debug(f"{scope} {msg}")


def _clean_metadata_for_serialization(metadata: Optional[dict]) -> Optional[dict]:
    # Shallow copy without process-group handles, which cannot be pickled.
    if metadata is None:
        return None
    clean = dict(metadata)
    clean.pop("dp_cp_group", None)
    return clean
