"""The request and the caller contract of asynchronous saves (re-exported by ``async_utils``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ckpt_tool._torchrun import group_initialized
from ..core import CheckpointingException

__all__ = ["AsyncRequest", "AsyncCaller", "collective_device"]


def collective_device() -> torch.device:
    """Device of small tensors for collectives: the current GPU under NCCL, else the CPU."""
    if group_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def staged_args(request: Any) -> list:
    """``request.async_fn_args`` with the staged data from ``request.preload_fn`` in place.

    ``request`` is any request with :class:`AsyncRequest`'s fields: Megatron-LM also schedules
    the requests of nvidia-resiliency-ext's local checkpoint manager, a class of its own.
    """
    args = list(request.async_fn_args)
    if request.preload_fn is not None:
        if len(args) != 3:
            raise CheckpointingException("Expected 3 args to be passed to async function")
        args[1] = request.preload_fn()
    return args


class AsyncRequest(NamedTuple):
    """A save split into a (background) write and finalize steps run on every rank.

    Args:
        async_fn: the write function; None when this rank has nothing to write.
        async_fn_args: its positional arguments; with ``preload_fn``, ``async_fn_args[1]`` is
            replaced by what ``preload_fn()`` returns (the staged data).
        finalize_fns: run in order on every rank once all ranks finished writing (they may
            use collectives); the checkpoint is complete only after them.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        preload_fn: stages the data to host memory; self-contained (a ``partial``).
        is_frozen: no finalize function may be added any more.
        call_idx: index given by the scheduling :class:`AsyncCallsQueue`.
    """

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: Dict = {}
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False
    call_idx: int = 0

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a finalize function (not allowed once the request is frozen)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def staged_args(self) -> list:
        """``async_fn_args`` with the staged data from ``preload_fn`` in place."""
        return staged_args(self)

    def execute_sync(self) -> None:
        """Stage, write and finalize in the calling process (a synchronous save)."""
        args = self.staged_args()
        if self.async_fn is not None:
            self.async_fn(*args, **self.async_fn_kwargs)
        if group_initialized():
            torch.distributed.barrier()
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        """A copy of the request that accepts no more finalize functions."""
        return self._replace(is_frozen=True)


class AsyncCaller(ABC):
    """Runs requests in a background process and tells when they are done on all ranks."""

    def __init__(self) -> None:
        self.failure: Optional[str] = None  # why the last finished call failed on this rank

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Stage the request's data and start its write (call on all ranks)."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the current call finished on all ranks (call on all ranks).

        With ``blocking`` wait for it. ``no_dist`` looks at this rank only (no collective).
        A call whose worker died counts as finished, with :attr:`failure` set.
        """

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """True when no rank has its call still running (one integer all-reduce)."""
        if not group_initialized():
            return not is_alive
        ten = torch.tensor([int(is_alive)], dtype=torch.int, device=collective_device())
        torch.distributed.all_reduce(ten)
        return int(ten[0]) == 0

    def take_failure(self) -> Optional[str]:
        """The failure of the last finished call on this rank (then forgotten), or None."""
        failure, self.failure = self.failure, None
        return failure

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Wait for (or with ``abort`` kill) the background process and release it."""
