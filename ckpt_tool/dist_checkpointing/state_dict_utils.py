"""State-dict preprocessing shared by ``save`` and ``load`` (Megatron-Core's names)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values
from .mapping import (
    CommonStateDict,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from .utils import _clean_metadata_for_serialization, extract_nonpersistent, extract_sharded_base
from .validation import determine_global_metadata, validate_sharding_integrity

__all__ = ["save_preprocess", "load_preprocess", "filter_out_empty_flatten_tensor"]


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[
        Callable[[CommonStateDict], StateDict]] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """Apply factories, drop non-persistent values and split off the common state dict.

    With ``validate_access_integrity`` the sharding of all ranks is checked (every tensor
    fully covered exactly once by main replicas) and the common state dict must agree across
    ranks, after ``preprocess_common_before_consistancy_check`` (which must not modify its
    argument) when given.

    Returns:
        (the sharded part, the common state dict)
    """
    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(sharded_state_dict)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    if validate_access_integrity:
        if "content_metadata" in common_state_dict:
            common_state_dict["content_metadata"] = _clean_metadata_for_serialization(
                common_state_dict["content_metadata"])
        checked = common_state_dict
        if preprocess_common_before_consistancy_check:
            checked = preprocess_common_before_consistancy_check(common_state_dict)
        validate_sharding_integrity(determine_global_metadata(sharded_part)[1],
                                    common_state_dict=checked)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict):
    """Prepare a load request without modifying it.

    Returns:
        (a copy with factories applied and non-persistent values removed,
         the unwrapped non-persistent values,
         the factories without data, to merge the loaded values back)
    """
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    sharded_state_dict = filter_out_empty_flatten_tensor(sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory),
        return_lists_as_dicts=True)
    apply_factories(sharded_state_dict)
    dict_list_map_inplace(ShardedTensorFactory.without_data, factories)
    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return sharded_state_dict, nonpersistent, factories


def filter_out_empty_flatten_tensor(sharded_state_dict):
    """Drop ShardedTensors whose ``flattened_range`` is empty (custom FSDP leftovers)."""

    def keep(v) -> bool:
        rng = getattr(v, "flattened_range", None) if isinstance(v, ShardedTensor) else None
        return not (rng is not None and rng.start == rng.stop)

    return extract_matching_values(sharded_state_dict, keep)[0]
