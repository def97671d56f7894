"""The DCP save split into planning, a (background) write and finalization.

Call order, on every rank::

    (writer, metadata, dist_wrapper), central_plan, local_plan, cache_ok, md_reuse = \\
        save_state_dict_async_plan(state_dict, writer, planner=planner,
                                   cached_ckpt_structure=previous_structure_or_None)
    fn, preload_fn, args = writer.get_save_function_and_args()   # run fn in the background
    save_state_dict_async_finalize(writer, metadata, dist_wrapper)  # after the write, all ranks

Planning gathers the local plans on the coordinator and scatters the global ones
(``torch.distributed.checkpoint``'s reduce-scatter); when the planner and the writer both allow
it (``can_run_decentralized_global_plan``, as Megatron-Core's), the coordinator only gathers the
local plans to build the metadata and every rank makes its global plan alone, and with
``loaded_all_plans`` that match every rank's plan not even that (the caller reuses the loaded
checkpoint's metadata). With ``cached_ckpt_structure`` from the
previous save, once validated (as in Megatron-Core: two consecutive saves planned the same),
the ranks only all-reduce one integer saying whether their local plans are unchanged; if they
all are, the cached global plan is reused and no plan crosses ranks (the caller supplies the
cached global metadata on the coordinator). A changed rank makes every rank plan afresh, so a
stale cache can never drop or misplace items.

Finalization gathers every rank's write results; the coordinator writes ``.metadata`` only if
all ranks succeeded, then broadcasts the outcome: a failure anywhere raises
:class:`CheckpointWriteError` on every rank (the details on the coordinator, the failed ranks
everywhere).
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper, _get_failure_dict

from ..core import CheckpointingException
from .async_utils import collective_device
from .filesystem_async import FileSystemWriterAsync

__all__ = ["save_state_dict_async_plan", "verify_global_md_reuse",
           "save_state_dict_async_finalize", "CheckpointWriteError", "CheckpointPlanError"]

logger = logging.getLogger(__name__)


class CheckpointWriteError(CheckpointingException, CheckpointException):
    """A save's write failed on some rank; ``.metadata`` was not written.

    Ours (:class:`CheckpointingException`) and torch's ``CheckpointException``, which
    Megatron-Core raises here and its tests expect; ``failures`` is torch's ``{rank: wrapped
    exception}``, filled on the coordinator only (as in Megatron-Core).
    """

    def __init__(self, message: str, failures: Optional[dict] = None):
        CheckpointingException.__init__(self, message)
        self._failures = dict(failures or {})


class CheckpointPlanError(CheckpointingException, CheckpointException):
    """The coordinator rejected a save's global plan; nothing was written."""

    def __init__(self, message: str):
        CheckpointingException.__init__(self, message)
        self._failures = {}


def _use_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _all_ranks_agree(flag: bool, dist_wrapper: _DistWrapper) -> bool:
    """True iff ``flag`` holds on every rank (one integer all-reduce)."""
    if not dist_wrapper.use_dist:
        return bool(flag)
    ten = torch.tensor([int(flag)], dtype=torch.int, device=collective_device())
    dist.all_reduce(ten, op=dist.ReduceOp.MIN, group=dist_wrapper.group)
    return int(ten.item()) == 1


def _plans_equal(a: Optional[SavePlan], b: Optional[SavePlan], skip=("storage_data",)) -> bool:
    if a is None or b is None:
        return False
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name not in skip)


def save_state_dict_async_plan(
    state_dict,
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[Tuple[SavePlan, SavePlan, bool]] = None,
    loaded_all_plans: Optional[List[SavePlan]] = None,
):
    """Plan the save and stage the data (first stage; call on every rank).

    Args:
        state_dict: the DCP state dict the planner resolves (may be empty for our planners).
        storage_writer: the writer that stages and later writes the data.
        process_group: group used for planning (default group when None).
        coordinator_rank: rank that builds the global plan and writes ``.metadata``.
        planner: the save planner.
        cached_ckpt_structure: ``(central_plan, local_plan, validated)`` returned by the
            previous save. As in Megatron-Core, the plan is reused only once ``validated``
            (two consecutive saves planned the same), and here only if every rank's local
            plan is still the cached one.
        loaded_all_plans: local plans stored in a loaded checkpoint's ``.metadata``; see
            :func:`verify_global_md_reuse`.

    Returns:
        ``((storage_writer, global_metadata, dist_wrapper), central_plan, local_plan,
        validated, global_md_verify_reuse)``: ``validated`` is true when the central plan
        is the cached one (reused, or planned afresh and equal on every rank);
        ``global_metadata`` is None on non-coordinators and when the cached plan or the
        loaded metadata is to be reused.
    """
    cached_central, cached_local, validated = cached_ckpt_structure or (None, None, False)
    dist_wrapper = _DistWrapper(process_group, _use_dist(), coordinator_rank)
    if planner is None:
        raise ValueError("a save planner is required")
    global_metadata: Optional[Metadata] = None

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict, is_coordinator=dist_wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(dist_wrapper.is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    def global_step(all_local_plans: List[SavePlan]) -> List[SavePlan]:
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    cache_reused = False
    global_md_verify_reuse = False
    local_plan = None
    if validated and cached_central is not None:
        local_plan = local_step()
        cache_reused = _all_ranks_agree(_plans_equal(local_plan, cached_local), dist_wrapper)
    if cache_reused:
        central_plan = cached_central
    elif _decentralized(planner, storage_writer):
        if local_plan is None:
            local_plan = local_step()
        global_md_verify_reuse = verify_global_md_reuse(
            loaded_all_plans, local_plan, dist_wrapper.get_rank(), dist_wrapper)
        if not global_md_verify_reuse:
            global_metadata = _coordinator_metadata(planner, local_plan, dist_wrapper)
        central_plan = storage_writer.prepare_decentralized_global_plan(
            planner.create_decentralized_global_plan(local_plan))
    else:
        if loaded_all_plans:
            local_plan = local_step()
            global_md_verify_reuse = verify_global_md_reuse(
                loaded_all_plans, local_plan, dist_wrapper.get_rank(), dist_wrapper)
        local_plan = None

        def map_fun() -> SavePlan:
            nonlocal local_plan
            local_plan = local_step()
            return local_plan

        central_plan = dist_wrapper.reduce_scatter("plan", map_fun, global_step)
    central_plan = planner.finish_plan(central_plan)
    if not cache_reused and cached_central is not None:  # planned afresh: the same plan again?
        cache_reused = _all_ranks_agree(central_plan == cached_central, dist_wrapper)
    storage_writer.prepare_write_data(central_plan, planner)
    return ((storage_writer, global_metadata, dist_wrapper), central_plan, local_plan,
            cache_reused, global_md_verify_reuse)


def _decentralized(planner: SavePlanner, storage_writer) -> bool:
    """Whether every rank may make its global plan alone (both say so, as in Megatron-Core)."""
    return bool(getattr(planner, "can_run_decentralized_global_plan", False)
                and getattr(storage_writer, "can_run_decentralized_global_plan", False))


def _coordinator_metadata(planner: SavePlanner, local_plan: SavePlan,
                          dist_wrapper: _DistWrapper) -> Optional[Metadata]:
    """The global metadata of a decentralized save, built on the coordinator from the gathered
    local plans (stored in it as ``all_local_plans``); None elsewhere. A plan the coordinator
    rejects (overlapping or out-of-bounds chunks) raises :class:`CheckpointPlanError` on every
    rank."""
    all_plans = dist_wrapper.gather_object(local_plan)
    metadata, error = None, None
    if dist_wrapper.is_coordinator:
        try:
            _, metadata = planner.create_global_plan(all_plans)
            metadata.all_local_plans = list(all_plans)
        except Exception as e:  # every rank must stop, not only this one
            error = repr(e)
    error = dist_wrapper.broadcast_object(error)
    if error is not None:
        raise CheckpointPlanError(
            f"Checkpoint save plan rejected on rank {dist_wrapper.coordinator_rank}: {error}")
    return metadata


def verify_global_md_reuse(loaded_all_plans: List[SavePlan], local_plan: SavePlan, rank: int,
                           dist_wrapper: _DistWrapper) -> bool:
    """Whether the global metadata of a loaded checkpoint fits this save on every rank.

    True iff the checkpoint has one stored local plan per rank and each rank's current local
    plan equals its stored one (ignoring storage prefixes). Collective when the number of
    stored plans matches the world size.
    """
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    return _all_ranks_agree(_plans_equal(local_plan, loaded_all_plans[rank]), dist_wrapper)


def save_state_dict_async_finalize(storage_writer: FileSystemWriterAsync,
                                   global_metadata: Optional[Metadata],
                                   dist_wrapper: _DistWrapper) -> None:
    """Gather the write results, write ``.metadata`` on the coordinator if every rank
    succeeded, and raise :class:`CheckpointWriteError` on every rank otherwise (call on every
    rank)."""
    write_results = storage_writer.retrieve_write_results()
    all_results = dist_wrapper.gather_object(write_results)
    summary, node_failures = None, {}
    if dist_wrapper.is_coordinator:
        node_failures = _get_failure_dict(all_results)
        if not node_failures:
            try:
                if global_metadata is None:
                    raise RuntimeError("no global metadata on the coordinator")
                storage_writer.finish(global_metadata, all_results)
            except Exception as e:  # every rank must learn about it, not only this one
                node_failures[dist_wrapper.get_rank()] = (e, [])
        if node_failures:
            summary = sorted(node_failures)
    failed_ranks = dist_wrapper.broadcast_object(summary)
    if failed_ranks is None:
        return
    if dist_wrapper.is_coordinator:
        details = "; ".join(f"rank {r}: {exc[0]!r}" for r, exc in sorted(node_failures.items()))
        raise CheckpointWriteError(
            f"Checkpoint write failed, .metadata not written ({details})", node_failures)
    own = ""
    if isinstance(write_results, tuple) and isinstance(write_results[0], BaseException):
        cause = write_results[0].__cause__ or write_results[0]  # this rank's own error
        own = f"this rank: {cause!r}; "
    raise CheckpointWriteError(
        f"Checkpoint write failed on rank(s) {', '.join(map(str, failed_ranks))}, .metadata "
        f"not written ({own}all details are in the exception on rank "
        f"{dist_wrapper.coordinator_rank})")
