"""A sharded state dict split into tensors and the rest, for local (in-memory) checkpointing.

Same names and semantics as Megatron-Core's ``dist_checkpointing.tensor_aware_state_dict``.
:class:`MCoreTensorAwareStateDict` is what NVIDIA Resiliency Extension's local checkpoint
manager saves: the common state, and the sharded part whose tensor data can be taken out
(:meth:`~MCoreTensorAwareStateDict.pop_tensors`), stored or sent elsewhere by the manager, and
put back (:meth:`~MCoreTensorAwareStateDict.insert_tensors`) before rebuilding a state dict
with :meth:`~MCoreTensorAwareStateDict.to_state_dict`.

It subclasses ``nvidia_resiliency_ext``'s ``TensorAwareStateDict`` when that package is
installed. Without it (``HAVE_NVRX`` False) the class still works, but, as in Megatron-Core,
:meth:`~MCoreTensorAwareStateDict.from_state_dict` raises ImportError.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .exchange_utils import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
)
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import (
    _sharded_object_id,
    _sharded_tensor_shard_id,
    debug_time,
    extract_sharded_base,
    zip_strict,
)
from .validation import (
    StrictHandling,
    determine_global_metadata,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)

__all__ = ["MCoreTensorAwareStateDict", "TensorAwareStateDict", "HAVE_NVRX",
           # imported names that Megatron-Core's module offers too
           "ShardDistribution", "ShardedObject", "ShardedTensor", "StrictHandling",
           "apply_factory_merges", "debug_time", "determine_global_metadata",
           "determine_main_replica_uniform_distribution", "dict_list_map_inplace",
           "dict_list_map_outplace", "exchange_by_distribution", "extract_sharded_base",
           "load_preprocess", "merge", "nested_values", "parse_strict_flag", "save_preprocess",
           "validate_integrity_and_strict_load", "zip_strict"]

logger = logging.getLogger(__name__)

try:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    HAVE_NVRX = True
except ImportError:
    TensorAwareStateDict = types.new_class("TensorAwareStateDict", ())
    HAVE_NVRX = False

# A popped ShardedTensor remembers the device type its data came from in this attribute.
_ORIG_DEVICE = "orig_device"


class HeldDataMissingError(CheckpointingException, AssertionError):
    """The request names a tensor or object this state dict does not hold.

    An ``AssertionError`` too: where Megatron-Core asserts, and what its tests of the
    pass-through strict modes expect.
    """


def _hollow_error(expected: bool) -> CheckpointingException:
    state = "hollow (tensors popped)" if not expected else "not hollow"
    return CheckpointingException(f"MCoreTensorAwareStateDict is {state}")


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """The common state dict and the sharded part of a Megatron-Core state dict.

    Args:
        common: the non-sharded values (as saved in ``common.pt``).
        sharded_state_dict: the sharded part (factories applied, non-persistent values dropped).
        _is_hollow: whether the tensor data is currently popped out.
    """

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @staticmethod
    def _validate_params(algo: str) -> None:
        if algo not in ("atomic", "fully_parallel"):
            raise NotImplementedError(
                'Only "atomic" and "fully_parallel" sharding algorithms are supported.')

    @staticmethod
    def _get_distribution(fully_parallel: bool, sharded_part: ShardedStateDict,
                          parallelization_group, cached_distribution=None):
        if not fully_parallel:
            return (None, None, None, None)
        if cached_distribution is not None:
            return cached_distribution
        return determine_main_replica_uniform_distribution(
            sharded_part, parallelization_group, True)

    @staticmethod
    def _remove_redundant_data(fully_parallel: bool, sharded_part: ShardedStateDict,
                               shard_to_saving_rank, parallelization_group) -> None:
        """Drop the data of tensors another rank of the group saves (objects are kept)."""
        if not fully_parallel:
            return
        rank = torch.distributed.get_rank(parallelization_group)
        for sh_base in nested_values(sharded_part):
            if isinstance(sh_base, ShardedTensor):
                if shard_to_saving_rank[_sharded_tensor_shard_id(sh_base)] != rank:
                    sh_base.data = None

    @classmethod
    @debug_time("from_state_dict", logger)
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: Optional[torch.distributed.ProcessGroup] = None,
        cached_metadata: Optional[ShardDistribution] = None,
    ) -> Tuple["MCoreTensorAwareStateDict", Optional[ShardDistribution]]:
        """Split ``sharded_state_dict`` (preprocessed as for a save) into a new instance.

        With ``algo="fully_parallel"`` the replicated tensors are spread over
        ``parallelization_group`` (default: the world): each rank keeps the data only of
        the tensors it is assigned (a collective unless ``cached_metadata`` is given).
        ``"atomic"`` keeps every main replica's data. Without ``cached_metadata`` the sharding
        of all ranks is validated as for a save.

        Returns:
            (the instance, the distribution to pass as ``cached_metadata`` next time; None for
            a single-rank group, ``(None,) * 4`` for ``"atomic"``)

        Raises ImportError without ``nvidia_resiliency_ext``, NotImplementedError for another
        ``algo``.
        """
        if not HAVE_NVRX:
            raise ImportError("nvidia_resiliency_ext is not installed. "
                              "Please install it with `pip install nvidia-resiliency-ext`")
        with debug_time("_get_distribution", logger):
            cls._validate_params(algo)
            fully_parallel = algo == "fully_parallel"
            sharded_part, common_state_dict = save_preprocess(
                sharded_state_dict, cached_metadata is None)
            distribution = cls._get_distribution(
                fully_parallel, sharded_part, parallelization_group, cached_metadata)
        if distribution is not None:
            cls._remove_redundant_data(
                fully_parallel, sharded_part, distribution[0], parallelization_group)
        return cls(common=common_state_dict, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        """True while the tensors are popped out and not inserted back yet."""
        return self._is_hollow

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        """The ShardedTensors whose data this instance holds (or held, when hollow).

        Tensors left without data by the fully parallel split are never included.
        """
        for sh_base in nested_values(self.sharded_state_dict):
            if not isinstance(sh_base, ShardedTensor):
                continue
            if self.is_hollow and hasattr(sh_base, _ORIG_DEVICE):
                yield sh_base
            elif not self.is_hollow and sh_base.data is not None:
                yield sh_base

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensor data, in a fixed order (that of :meth:`pop_tensors`)."""
        if self.is_hollow:
            raise _hollow_error(False)
        return (sh_ten.data for sh_ten in self._sharded_tensors)

    @property
    def common_state_dict(self) -> Dict:
        """The common (non-sharded) state dict."""
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensor data out (the instance becomes hollow) and return it in order.

        Each ShardedTensor remembers the device type of its data; metadata stays.
        """
        if self.is_hollow:
            raise _hollow_error(False)
        popped = []
        for sh_ten in list(self._sharded_tensors):
            popped.append(sh_ten.data)
            setattr(sh_ten, _ORIG_DEVICE, sh_ten.data.device.type)
            sh_ten.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in :meth:`pop_tensors` order (the counts must match).

        ``self.insert_tensors(self.pop_tensors())`` leaves the instance as it was. A tensor on
        another device than the original keeps that device recorded, so that
        :meth:`restore_tensor_device` can move it back.
        """
        if not self.is_hollow:
            raise _hollow_error(True)
        for sh_ten, tensor in zip_strict(self._sharded_tensors, tensor_data):
            if getattr(sh_ten, _ORIG_DEVICE) == tensor.device.type:
                delattr(sh_ten, _ORIG_DEVICE)
            sh_ten.data = tensor
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Instead of inserting tensors: allocate empty ones (shape, dtype, original device)."""
        if not self.is_hollow:
            raise _hollow_error(True)
        for sh_ten in list(self._sharded_tensors):
            sh_ten.init_data(getattr(sh_ten, _ORIG_DEVICE))
            delattr(sh_ten, _ORIG_DEVICE)
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the data by CPU copies (the originals are not modified).

        Data already on the CPU is cloned unless it is already a copy made here; the original
        device is remembered for :meth:`restore_tensor_device`.
        """
        if self.is_hollow:
            raise _hollow_error(False)
        for sh_ten in self._sharded_tensors:
            is_copy = hasattr(sh_ten, _ORIG_DEVICE)
            if sh_ten.data.device.type == "cpu":
                if not is_copy:
                    sh_ten.data = sh_ten.data.clone()
                continue
            if not is_copy:
                setattr(sh_ten, _ORIG_DEVICE, sh_ten.data.device.type)
            sh_ten.data = sh_ten.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move data that was moved away (see :meth:`copy_tensors_to_cpu`) back."""
        if self.is_hollow:
            raise _hollow_error(False)
        for sh_ten in self._sharded_tensors:
            if hasattr(sh_ten, _ORIG_DEVICE):
                sh_ten.data = sh_ten.data.to(getattr(sh_ten, _ORIG_DEVICE),
                                             non_blocking=non_blocking)
                delattr(sh_ten, _ORIG_DEVICE)

    def _insert_sharded_data(self, fully_parallel: bool, sharded_part: ShardedStateDict,
                             parallelization_group, exchange_algo: str) -> None:
        """Replace the sharded values of ``sharded_part`` by the held data (in place); with
        ``fully_parallel`` the tensors held by other ranks are exchanged first."""
        loaded_tensors = {_sharded_tensor_shard_id(t): t.data for t in self._sharded_tensors}
        if fully_parallel:
            with debug_time("_get_distribution", logger):
                distribution = self._get_distribution(True, sharded_part, parallelization_group)
            if distribution is not None:
                unloaded = {}
                for sh_base in nested_values(sharded_part):
                    if isinstance(sh_base, ShardedTensor):
                        shard_id = _sharded_tensor_shard_id(sh_base)
                        if shard_id not in loaded_tensors:
                            unloaded[shard_id] = sh_base
                with debug_time("exchange_by_distribution", logger):
                    loaded_tensors = exchange_by_distribution(
                        loaded_tensors, unloaded, distribution, parallelization_group,
                        exchange_algo)
                    if torch.cuda.is_initialized():
                        torch.cuda.synchronize()
        loaded_objects = {_sharded_object_id(o): o.data
                          for o in nested_values(self.sharded_state_dict)
                          if isinstance(o, ShardedObject)}

        def held_value(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                ids, table, what = _sharded_tensor_shard_id(x), loaded_tensors, "tensor"
            elif isinstance(x, ShardedObject):
                ids, table, what = _sharded_object_id(x), loaded_objects, "object"
            else:
                return x
            if ids not in table:
                raise HeldDataMissingError(
                    f"No {what} data held for {x.key!r} (an unexpected key of the request?): "
                    "request only what the state dict was made from, or load with "
                    "strict=StrictHandling.RAISE_UNEXPECTED to list such keys")
            return table[ids]

        dict_list_map_inplace(held_value, sharded_part)

    @debug_time("to_state_dict", logger)
    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: Optional[torch.distributed.ProcessGroup] = None,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ):
        """A state dict like ``dist_checkpointing.load`` returns for ``sharded_state_dict``.

        The common part, the non-persistent values of the request and the held tensor and
        object data (not copies) where the request has sharded values; factories are merged.
        ``algo="fully_parallel"`` first exchanges the tensors over ``parallelization_group``
        with ``exchange_algo``. ``strict`` and ``validate_access_integrity`` act as in
        ``load``; with ``return_mismatch_keys`` returns ``(state dict, missing keys,
        unexpected keys)``.
        """
        with debug_time("load_preprocess_and_state_dict_manipulations", logger):
            if self.is_hollow:
                raise _hollow_error(False)
            self._validate_params(algo)
            fully_parallel = algo == "fully_parallel"
            recreated = dict_list_map_outplace(lambda x: x, self.common)
            if not sharded_state_dict:
                return recreated
            sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
            merge(recreated, nonpersistent)
            sharded_part, _ = extract_sharded_base(sharded_state_dict)

        strict = parse_strict_flag(strict)
        ckpt_sharded_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_sharded_metadata = {sh.key: sh.without_data()
                                     for sh in nested_values(self.sharded_state_dict)}
        local_metadata = global_metadata = None
        if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
            local_metadata, global_metadata = determine_global_metadata(sharded_part)
        # As Megatron-Core 0.16.1 (and its tests: the "pass-through" strict modes), the
        # request is served unfiltered: an unexpected key then fails in the insertion below.
        _, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
            sharded_part, strict, validate_access_integrity, local_metadata, global_metadata,
            ckpt_sharded_metadata)

        with debug_time("_insert_sharded_data", logger):
            self._insert_sharded_data(fully_parallel, sharded_part, parallelization_group,
                                      exchange_algo)
        with debug_time("apply_factory_merges", logger):
            sharded_part = apply_factory_merges(sharded_part, factories)
            merge(recreated, sharded_part)
        if return_mismatch_keys:
            return recreated, missing_keys, unexpected_keys
        return recreated
