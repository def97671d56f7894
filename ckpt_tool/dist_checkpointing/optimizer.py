"""Sharding of optimizer state derived from the sharding of the model parameters.

A (non-distributed) optimizer state tensor such as Adam's ``exp_avg`` has the same shape and
placement as its parameter, so its ShardedTensor is the parameter's one with another key and
data. Same names and behaviour as Megatron-Core's ``dist_checkpointing.optimizer``.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Dict, Iterable, Tuple, Union

import torch

from ._mcore_names import log_single_rank, to_local_if_dtensor  # noqa: F401 (re-exported as in MCore)
from .dict_utils import nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from .utils import extract_sharded_tensors_and_factories

__all__ = [
    "KEEP_VARS_HINT",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]

logger = logging.getLogger(__name__)

KEEP_VARS_HINT = (
    " Make sure state dict contains original torch.nn.Parameters (not pure torch.Tensors)"
    " by passing `keep_vars=True` to `.state_dict()`. If any transformation of the original"
    " parameter is needed, use a ShardedTensorFactory."
)


def _to_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2); any other tensor unchanged."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is None or type(tensor).__name__ != "DTensor":
        return tensor
    with torch.no_grad():
        return to_local()


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, int]:
    """Map ``id(param)`` to its position in the optimizer's parameter order.

    The position is the integer key of that parameter in ``optimizer.state_dict()["state"]``.
    A parameter listed twice keeps its first position.
    """
    positions: Dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        positions.setdefault(id(_to_local(param)), i)
    return positions


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> Dict[int, Union[ShardedTensor, ShardedTensorFactory]]:
    """Map optimizer state ids to the model's ShardedTensors/factories of the same parameter.

    Args:
        model_sharded_state_dict: the model's sharded state dict (any nesting). Its sharded
            values must hold the very parameter objects (``state_dict(keep_vars=True)``).
        optim_params_iter: the parameters tracked by the optimizer, in the optimizer's order.

    Sharded values whose data the optimizer does not track are skipped; a warning is logged
    (on rank 0) if nothing matched at all.
    """
    sharded_part, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_positions = get_optim_param_to_id_map(optim_params_iter)
    result: Dict[int, Union[ShardedTensor, ShardedTensorFactory]] = {}
    for sh_ten in nested_values(sharded_part):
        position = param_positions.get(id(sh_ten.data))
        if position is None:
            logger.debug(f"{sh_ten} is not tracked by the optimizer")
        else:
            result[position] = sh_ten
    if not result and _is_rank_zero():
        logger.warning(
            "Sharded parameters mapping is empty. It means tensors in model state dict"
            " do not correspond to tensors in optimizer parameters map."
            " Make sure to call state_dict with `keep_vars=True`."
        )
    return result


def make_sharded_optimizer_tensor(
    model_param: Union[ShardedTensor, ShardedTensorFactory], optim_param: torch.Tensor, prefix: str
) -> Union[ShardedTensor, ShardedTensorFactory]:
    """Sharded value for one optimizer state tensor, placed like ``model_param``.

    The key becomes ``f"{prefix}.{model_param.key}"`` and the data ``optim_param`` (whose shape
    must equal the parameter's local shape; its dtype may differ, e.g. fp32 states of bf16
    weights). Factories are copied with the new key and data.
    """
    optim_param = _to_local(optim_param)
    new_key = f"{prefix}.{model_param.key}"
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=new_key, data=optim_param)

    assert tuple(optim_param.shape) == tuple(model_param.local_shape), (
        f"Optimizer shape ({tuple(optim_param.shape)} does not match model shape "
        f"({model_param.local_shape})"
    )
    # `replace` re-validates the metadata against the new data.
    return replace(model_param, key=new_key, data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, ShardedTensor],
    exclude_keys: Tuple[str, ...] = (),
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded one, in place.

    Every tensor ``state[param_id][name]`` becomes a sharded value keyed
    ``optimizer.state.<name>.<model key>`` (e.g. ``exp_avg`` and ``exp_avg_sq`` for Adam),
    except names in ``exclude_keys``, which are dropped. ``param_groups`` are deep-copied and
    their ``params`` lists wrapped in :class:`LocalNonpersistentObject` (restored from the
    running optimizer, never saved). A param id missing from ``id_to_sharded_param_map``
    raises ValueError.
    """
    sharded_state = {}
    for param_id, param_state in optim_state_dict["state"].items():
        per_param = sharded_state[param_id] = {}
        for state_key, value in param_state.items():
            if state_key in exclude_keys:
                continue
            if param_id not in id_to_sharded_param_map:
                raise ValueError(f"Param id {param_id} does not match any model sharded param")
            per_param[state_key] = make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{state_key}"
            )

    param_groups = deepcopy(optim_state_dict["param_groups"])
    for group in param_groups:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["param_groups"] = param_groups
    optim_state_dict["state"] = sharded_state
