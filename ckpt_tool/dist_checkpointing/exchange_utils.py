"""Planning which rank saves or loads each shard, and exchanging loaded shards between ranks.

Same names and semantics as Megatron-Core's ``dist_checkpointing.exchange_utils``: replicas of
a shard on several ranks of a parallelization group are assigned to one of them, balanced by
bytes with a deterministic greedy algorithm (every rank computes the same plan from the
exchanged metadata, so no further communication is needed). Unlike Megatron-Core, the exchange
works on any backend: on gloo the tensors stay on the CPU, on NCCL they travel through CUDA.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from itertools import zip_longest
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from ._mcore_names import HAVE_TE_FLOAT8TENSOR, get_pg_rank, get_pg_size, log_single_rank  # noqa: F401 (as MCore)
from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import ShardedStateDict, ShardedTensor, is_main_replica
from .utils import _is_quantized_fp8, _sharded_tensor_shard_id, _ShardId, debug_time

__all__ = [
    "ShardDistribution",
    "is_float8tensor",
    "distribute_shards_to_ranks",
    "determine_main_replica_uniform_distribution",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "exchange_loaded_objects_gather_object",
    "exchange_by_distribution",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def is_float8tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a Transformer Engine FP8 tensor (checked without importing TE)."""
    return _is_quantized_fp8(tensor)


class ShardDistribution(NamedTuple):
    """Which rank of a parallelization group handles each shard (the group is implicit).

    Args:
        main_rank_for_shard: the rank (within the group) that saves/loads each shard.
        shards_in_this_group: shards with a main replica in this group (on load, also
            those only needed here).
        shard_to_metadata: a data-less ShardedTensor describing each shard.
        all_ranks_for_shard: the ranks (within the group) that hold or need each shard.
    """

    main_rank_for_shard: Dict[_ShardId, int]
    shards_in_this_group: Set[_ShardId]
    shard_to_metadata: Dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[_ShardId, List[int]]


def _shard_numel(sh_ten: ShardedTensor) -> int:
    numel = 1
    for n in sh_ten.local_shape:
        numel *= int(n)
    return numel


def _shard_size(sh_ten: ShardedTensor) -> int:
    """Bytes of the (unflattened) local shard."""
    return _shard_numel(sh_ten) * torch.empty((), dtype=sh_ten.dtype).element_size()


def _group_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group=group)


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Set[T],
) -> Dict[T, int]:
    """Assign each shard to one of the ranks holding it, balancing the bytes per rank.

    Greedy and deterministic: shards are taken in the order (main replica in this group
    first, then fewest holders, then largest, then shard id) and each goes to the holder with
    the fewest bytes assigned so far (lowest rank on ties).

    Args:
        shard_to_ranks: ranks (within the group) that hold each shard.
        shard_to_size: bytes of each shard.
        num_ranks: size of the group.
        cross_parallelization_group_loads: shards whose main replica is in another group
            (assigned last, so that load and save distributions stay alike).

    Returns:
        shard -> assigned rank.
    """
    assigned_bytes = [0] * num_ranks
    assignment: Dict[T, int] = {}

    def order(item):
        shard_id, ranks = item
        return (shard_id in cross_parallelization_group_loads, len(ranks),
                -shard_to_size[shard_id], shard_id)

    for shard_id, ranks in sorted(shard_to_ranks.items(), key=order):
        rank = min(set(ranks), key=lambda r: (assigned_bytes[r], r))
        assignment[shard_id] = rank
        assigned_bytes[rank] += shard_to_size[shard_id]
    logger.debug("distribute_shards_to_ranks bytes per rank: %s", assigned_bytes)
    return assignment


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Optional[dist.ProcessGroup],
    ignore_groups: bool = False,
) -> Optional[ShardDistribution]:
    """Gather the ShardedTensor metadata of the group and plan who saves (or loads) what.

    Collective over ``parallelization_group`` (default: the whole world). Apply the result
    with ``fully_parallel.distribute_main_replicas_with_precomputed_distribution``.

    Args:
        sharded_state_dict: this rank's state dict.
        parallelization_group: the group sharing the work.
        ignore_groups: plan also shards that have no main replica in the group (on load
            every needed shard must be read by someone in the group).

    Returns:
        the distribution, or None when the group has a single rank.
    """
    if parallelization_group is None:
        parallelization_group = dist.group.WORLD
    group_size = _group_size(parallelization_group)
    if group_size <= 1:
        return None
    local = [sh.without_data() for sh in nested_values(sharded_state_dict)
             if isinstance(sh, ShardedTensor)]
    gathered: List[Any] = [None] * group_size
    dist.all_gather_object(gathered, local, group=parallelization_group)

    shard_to_ranks: Dict[_ShardId, List[int]] = defaultdict(list)
    shard_to_size: Dict[_ShardId, int] = {}
    shard_to_metadata: Dict[_ShardId, ShardedTensor] = {}
    with_main: Set[_ShardId] = set()
    without_main: Set[_ShardId] = set()
    for rank, rank_shards in enumerate(gathered):
        for sh in rank_shards:
            shard_id = _sharded_tensor_shard_id(sh)
            shard_to_ranks[shard_id].append(rank)
            if shard_id not in shard_to_metadata:
                shard_to_size[shard_id] = _shard_size(sh)
                shard_to_metadata[shard_id] = sh
            (with_main if is_main_replica(sh.replica_id) else without_main).add(shard_id)

    in_group = with_main | without_main if ignore_groups else set(with_main)
    cross_group = in_group - with_main
    shard_to_ranks = {k: v for k, v in shard_to_ranks.items() if k in in_group}
    assignment = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, group_size,
                                            cross_group)
    return ShardDistribution(assignment, in_group, shard_to_metadata, shard_to_ranks)


# ------------------------------------------------------------------ exchanging loaded shards


def _comm_device(group) -> torch.device:
    """CUDA for NCCL groups, else the CPU (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _empty_like_shard(sh_ten: ShardedTensor, device) -> torch.Tensor:
    rng = sh_ten.flattened_range
    shape = (rng.stop - rng.start,) if rng is not None else tuple(sh_ten.local_shape)
    return torch.empty(shape, dtype=sh_ten.dtype, device=device)


def _get_empty_tensor_for_exchange(
    shard_id: _ShardId,
    needed_shards: Dict[_ShardId, ShardedTensor],
    unneeded_shards: Dict[_ShardId, ShardedTensor],
    loaded_tensors: Dict[_ShardId, torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """The tensor to receive ``shard_id`` into, and the device of this rank's destination
    (``None`` when this rank only relays the shard and discards it).

    A needed shard is received into its own ``data`` (allocated on the comm device when
    absent) when that lives on the comm device and is contiguous, otherwise into a new buffer
    that the exchange copies into ``data`` afterwards; a shard this rank does not need gets a
    buffer shaped after ``unneeded_shards[shard_id]``. Called once per received shard (tests
    count the calls), looked up at call time so that it can be instrumented.
    """
    device = _exchange_device
    sh_ten = needed_shards.get(shard_id)
    if sh_ten is None:
        return _empty_like_shard(unneeded_shards[shard_id], device), None
    sh_ten.init_data(device)
    data = sh_ten.data
    if data.device == device and data.is_contiguous():
        return data, data.device
    return torch.empty(data.shape, dtype=data.dtype, device=device), data.device


_exchange_device = torch.device("cpu")  # set by each exchange to its group's comm device


def _receive_target(shard_id: _ShardId, needed: Dict[_ShardId, ShardedTensor],
                    metadata: Dict[_ShardId, ShardedTensor], device,
                    loaded: Dict[_ShardId, torch.Tensor]
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(buffer to receive into, final destination or None when this rank discards it)."""
    global _exchange_device
    _exchange_device = torch.device(device)
    buffer, orig_device = _get_empty_tensor_for_exchange(shard_id, needed, metadata, loaded)
    return buffer, (None if orig_device is None else needed[shard_id].data)


def _exchanged_shards(distribution: ShardDistribution) -> List[Tuple[_ShardId, int]]:
    """Shards that some rank other than their loader needs, with their loader."""
    out = []
    for shard_id, rank in distribution.main_rank_for_shard.items():
        holders = distribution.all_ranks_for_shard[shard_id]
        if len(holders) == 1:
            if holders[0] != rank:
                raise CheckpointingException(
                    f"Shard {shard_id} is needed only by rank {holders[0]} but assigned to "
                    f"rank {rank}")
            continue
        out.append((shard_id, rank))
    return out


def _finish(result: Dict[_ShardId, torch.Tensor], shard_id, received: torch.Tensor,
            destination: Optional[torch.Tensor]) -> None:
    if destination is None:
        return
    if destination is not received:
        destination.copy_(received)
    result[shard_id] = destination


@torch.no_grad()
@debug_time("exchange_loaded_tensors_broadcast", logger)
def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Each loaded shard needed elsewhere is broadcast by its loader to the group.

    Args:
        loaded_tensors: shards this rank loaded, by shard id.
        unloaded_shards: ShardedTensors this rank needs but did not load, by shard id.
        shard_distribution: the load distribution (identical on every rank).
        parallelization_group: the group of the distribution (default: the world).

    Returns:
        every shard this rank needs (``loaded_tensors`` included), by shard id.
    """
    group = dist.group.WORLD if parallelization_group is None else parallelization_group
    device = _comm_device(group)
    local_rank = dist.get_rank(group=group)
    result = dict(loaded_tensors)
    for shard_id, rank in _exchanged_shards(shard_distribution):
        if rank == local_rank:
            send = result[shard_id]
            if send.device != device or not send.is_contiguous():
                send = send.to(device).contiguous()
            dist.broadcast(send, src=dist.get_global_rank(group, rank), group=group)
            continue
        buffer, destination = _receive_target(
            shard_id, unloaded_shards, shard_distribution.shard_to_metadata, device, result)
        dist.broadcast(buffer, src=dist.get_global_rank(group, rank), group=group)
        _finish(result, shard_id, buffer, destination)
    return result


@torch.no_grad()
@debug_time("exchange_loaded_tensors_gather_rounds", logger)
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: Optional[ShardDistribution] = None,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Exchange in rounds of ``all_gather``: per dtype, round i carries every rank's i-th shard.

    Shards of a round are flattened and padded to the round's largest (known to every rank
    from the metadata), so the collective has equal sizes on any backend.
    Arguments and result as :func:`exchange_loaded_tensors_broadcast`.
    """
    if shard_distribution is None:
        raise CheckpointingException("exchange_loaded_tensors_gather_rounds needs the "
                                     "shard_distribution of the load")
    group = dist.group.WORLD if parallelization_group is None else parallelization_group
    device = _comm_device(group)
    local_rank = dist.get_rank(group=group)
    world = dist.get_world_size(group=group)
    metadata = shard_distribution.shard_to_metadata
    result = dict(loaded_tensors)
    exchanged = _exchanged_shards(shard_distribution)
    for dtype in sorted({metadata[s].dtype for s, _ in exchanged}, key=str):
        per_rank: List[List[_ShardId]] = [[] for _ in range(world)]
        for shard_id, rank in exchanged:
            if metadata[shard_id].dtype == dtype:
                per_rank[rank].append(shard_id)
        for round_ids in zip_longest(*per_rank):
            sizes = [0 if s is None else _empty_like_shard(metadata[s], "meta").numel()
                     for s in round_ids]
            width = max(sizes)
            mine = round_ids[local_rank]
            send = torch.zeros(width, dtype=dtype, device=device)
            if mine is not None:
                send[: sizes[local_rank]] = result[mine].reshape(-1).to(device)
            buffers = [torch.empty(width, dtype=dtype, device=device) for _ in range(world)]
            dist.all_gather(buffers, send, group=group)
            for rank, shard_id in enumerate(round_ids):
                if shard_id is None or rank == local_rank or shard_id not in unloaded_shards:
                    continue
                unloaded_shards[shard_id].init_data(device)
                destination = unloaded_shards[shard_id].data
                received = buffers[rank][: sizes[rank]].view(destination.shape)
                _finish(result, shard_id, received, destination)
    return result


def _gather_dicts(local: Dict[_ShardId, Any], group) -> Dict[_ShardId, Any]:
    gathered: List[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(gathered, local, group=group)
    merged: Dict[_ShardId, Any] = {}
    for part in gathered:
        merged.update(part)
    if len(merged) != sum(len(part) for part in gathered):
        raise CheckpointingException(
            "Duplicate shard ids loaded by different ranks: "
            f"{[sorted(part, key=str) for part in gathered]}")
    return merged


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[_ShardId, torch.Tensor]:
    """Exchange with one ``all_gather_object`` of every rank's loaded shards (simple, slow:
    every rank receives everything). Arguments and result as the broadcast variant.
    """
    return _gather_dicts(loaded_tensors, parallelization_group)


def exchange_loaded_objects_gather_object(
    loaded_objects: Dict[_ShardId, Any]
) -> Dict[_ShardId, Any]:
    """All ShardedObject values loaded by any rank of the world, by shard id.

    Raises CheckpointingException when two ranks loaded the same object.
    """
    return _gather_dicts(loaded_objects, None)


_EXCHANGE_ALGOS = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_object": exchange_loaded_tensors_gather_object,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
}


def exchange_by_distribution(
    loaded_tensors: Dict[_ShardId, torch.Tensor],
    unloaded_shards: Dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    exchange_algo: str = "broadcast",
) -> Dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards with ``exchange_algo``: ``broadcast`` (default),
    ``gather_object`` or ``gather_rounds``. Arguments and result as the broadcast variant.
    """
    if shard_distribution is None:
        raise CheckpointingException("Expecting distribution to perform exchange")
    try:
        exchange = _EXCHANGE_ALGOS[exchange_algo]
    except KeyError:
        raise NotImplementedError(f"Unrecognized gather algorithm: {exchange_algo}") from None
    return exchange(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)
