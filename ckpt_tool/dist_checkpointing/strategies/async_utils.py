"""Run the write step of a checkpoint save in a background process (Megatron-Core's API).

A save strategy returns an :class:`AsyncRequest`; an :class:`AsyncCallsQueue` schedules it and
later finalizes it. Call order, on every rank::

    queue = AsyncCallsQueue(persistent=False)
    request = save(sharded_state_dict, ckpt_dir, async_sharded_save=True)  # data staged
    queue.schedule_async_request(request)     # write starts in a background process
    ... training goes on, live tensors may change ...
    queue.maybe_finalize_async_calls(blocking=False)  # finalizes the calls done on all ranks
    queue.close()                             # waits for / ends the workers

The write runs in a process forked per request (:class:`TemporalAsyncCaller`) or in one spawned
worker kept across saves (:class:`PersistentAsyncCaller`). A worker that raises or dies is
detected (exit status / missing answer); an all-reduce tells every rank, which then raises
:class:`CheckpointingException` without finalizing: no completeness marker is written.
"""

from __future__ import annotations

import gc
import logging
import os
import queue as queue_mod
import select
import traceback
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

from ckpt_tool._torchrun import group_initialized
from .._staging import SharedSegment, _StagedPickler, dumps_staged, loads_staged
from .._staging_pool import release_staging_memory
from .._mcore_names import log_single_rank  # noqa: F401 (re-exported as in MCore)
from ..core import CheckpointingException
from ..utils import debug_time
from ._async_request import AsyncCaller, AsyncRequest, collective_device, staged_args

__all__ = ["AsyncRequest", "AsyncCaller", "TemporalAsyncCaller", "PersistentAsyncCaller",
           "AsyncCallsQueue"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a blocking wait looks at the worker
_FORK_ACK_S = 10.0  # a forked writer that has not started by then is hung
_FORK_ATTEMPTS = 3


def _forked_main(ack_fd: int, async_fn: Callable, args: list, kwargs: dict) -> None:
    """A forked writer: tells the parent it started, then writes (an error: exit code 1)."""
    os.write(ack_fd, b"1")
    os.close(ack_fd)
    async_fn(*args, **kwargs)


@contextmanager
def _disable_gc():
    """Garbage collection off for the duration (as it was before afterwards)."""
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class TemporalAsyncCaller(AsyncCaller):
    """Forks one process per request; it exits when the write is done.

    A forked child can hang before running any Python code when another thread held an
    interpreter lock at fork time (CPython < 3.11.8, gh-112275); a child that does not report
    its start within ``_FORK_ACK_S`` is killed and forked again.
    """

    def __init__(self) -> None:
        super().__init__()
        self.process: Optional[mp.Process] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        args = staged_args(async_req)
        ctx = mp.get_context("fork")
        for _ in range(_FORK_ATTEMPTS):
            ack_r, ack_w = os.pipe()
            process = ctx.Process(target=_forked_main, daemon=True,
                                  args=(ack_w, async_req.async_fn, args,
                                        async_req.async_fn_kwargs))
            try:
                process.start()
            finally:
                os.close(ack_w)
            started = select.select([ack_r], [], [], _FORK_ACK_S)[0]
            os.close(ack_r)
            if started:  # the child wrote, or died (EOF): its exit code tells
                self.process = process
                return
            logger.warning("Forked checkpoint writer %d did not start; forking again",
                           process.pid)
            process.kill()
            process.join()
            process.close()
        self.failure = f"could not start a forked checkpoint writer in {_FORK_ATTEMPTS} tries"

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        is_alive = int(self.process.is_alive()) if self.process is not None else 0
        is_done = not is_alive if no_dist else self.sync_all_async_calls(is_alive)
        if is_done or blocking:
            self.close()
            is_done = True
        return is_done

    def close(self, abort: bool = False) -> None:
        if self.process is None:
            return
        if abort:
            self.process.kill()
        self.process.join()
        if self.process.exitcode != 0 and not abort:
            self.failure = (f"async checkpoint writer (pid {self.process.pid}) exited with "
                            f"code {self.process.exitcode}")
        self.process.close()
        self.process = None


class _RequestPickler(_StagedPickler, ForkingPickler):
    """Pickles a request for the persistent worker: tensors staged in a shared segment travel
    as references to it, any other tensor the way ``torch.multiprocessing`` sends it."""


def _dumps_request(request: AsyncRequest) -> bytes:
    return dumps_staged(request, _RequestPickler)[0]


class _SegmentCache:
    """The worker's mappings of the training process's staging segments, kept across requests
    (the pool reuses them); a mapping whose file is gone (released by its owner) is dropped."""

    def __init__(self) -> None:
        self.mapped: Dict[str, SharedSegment] = {}

    def attach(self, path: str, nbytes: int) -> SharedSegment:
        seg = self.mapped.get(path)
        if seg is None or seg.nbytes != nbytes:
            seg = self.mapped[path] = SharedSegment.attach(path, nbytes)
        return seg

    def drop_released(self) -> None:
        for path in [p for p in self.mapped if not os.path.exists(p)]:
            self.mapped.pop(path).close()


class PersistentAsyncCaller(AsyncCaller):
    """One spawned worker process that runs the requests one after another.

    Requests reach it through a queue (staged tensors as references to the shared staging
    segments it maps once and keeps; see :mod:`.._staging_pool`); it answers
    ``(call_idx, error or None)`` on a completion queue. A dead worker fails every call it
    had not answered and is replaced at the next schedule, with new queues (a killed process
    may hold their locks).
    """

    def __init__(self) -> None:
        super().__init__()
        self.process: Optional[mp.Process] = None
        self.queue = self.comp_q = None
        self.pending: deque = deque()  # indices of scheduled, unfinished calls, oldest first
        self.answers: Dict[int, Optional[str]] = {}  # call index -> error or None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.queue, self.comp_q = ctx.Queue(), ctx.Queue()
        rank = torch.distributed.get_rank() if group_initialized() else 0
        self.process = ctx.Process(target=PersistentAsyncCaller.async_loop,
                                   args=(rank, self.queue, None, self.comp_q,
                                         logger.getEffectiveLevel()), daemon=True)
        self.process.start()

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        self.pending.append(async_req.call_idx)
        if async_req.async_fn is None:  # nothing to write on this rank: done already
            self.answers[async_req.call_idx] = None
            return
        if self.process is None or not self.process.is_alive():
            self._release(kill=True)
            self._start()
        staged = async_req._replace(async_fn_args=tuple(staged_args(async_req)),
                                    preload_fn=None, finalize_fns=[])
        self.queue.put((async_req.call_idx, _dumps_request(staged)))

    def _drain(self, timeout: float) -> None:
        """Collect answers; a dead (or absent) worker fails every unanswered call."""
        try:
            while self.comp_q is not None:
                idx, error = self.comp_q.get(timeout=timeout)
                self.answers[idx] = error
                timeout = 0.0
        except queue_mod.Empty:
            pass
        if self.pending[0] in self.answers:
            return
        if self.process is not None and self.process.is_alive():
            return
        try:  # an answer sent just before the exit may still be in the pipe
            if self.comp_q is None:
                raise queue_mod.Empty
            idx, error = self.comp_q.get(timeout=_POLL_S)
            self.answers[idx] = error
        except queue_mod.Empty:
            death = ("persistent checkpoint worker is gone" if self.process is None else
                     f"persistent checkpoint worker (pid {self.process.pid}) died with "
                     f"exit code {self.process.exitcode}")
            for idx in self.pending:
                self.answers.setdefault(idx, death)
            self._release(kill=True)

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the oldest pending call of this worker is done (see the base class)."""
        is_alive = 0
        while self.pending:
            head = self.pending[0]
            if head not in self.answers:
                self._drain(_POLL_S if blocking else 0.0)
            if head in self.answers:
                self.failure = self.answers.pop(head)
            elif blocking:
                continue
            else:
                is_alive = 1
                break
            self.pending.popleft()
            break
        return not is_alive if no_dist else self.sync_all_async_calls(is_alive)

    def _release(self, kill: bool) -> None:
        if self.process is not None:
            if kill:
                self.process.kill()
            self.process.join()
            self.process.close()
            self.process = None
        for q in (self.queue, self.comp_q):
            if q is not None:
                if kill:  # nobody may read what is still buffered: do not wait for it
                    q.cancel_join_thread()
                q.close()
                q.join_thread()
        self.queue = self.comp_q = None

    def close(self, abort: bool = False) -> None:
        if self.process is not None and not abort and self.process.is_alive():
            self.queue.put("DONE")
        self._release(kill=abort)

    def __del__(self) -> None:
        try:
            self.close(abort=True)
        except Exception:  # interpreter shutdown: nothing left to release
            pass

    @staticmethod
    def async_loop(rank: int, queue: Any, preload_q: Any, comp_q: Any,
                   log_level: int = logging.INFO) -> None:
        """Body of the worker: run requests until ``"DONE"``; report each outcome.

        ``preload_q`` is MCore's channel for staging in the worker; ours stages in the
        training process before scheduling (the request carries the staged data), so it is
        unused and may be ``None``.
        """
        logging.getLogger(__name__).setLevel(log_level)
        segments = _SegmentCache()
        while True:
            item = queue.get()
            if isinstance(item, str) and item == "DONE":
                break
            error = None
            call_idx, payload = item
            try:
                segments.drop_released()
                item = loads_staged(payload, segments.attach)
                item.async_fn(*item.async_fn_args, **item.async_fn_kwargs)
            except BaseException as e:  # report, stay alive for the next save
                error = f"rank {rank}: async checkpoint write failed: {e!r}"
                traceback.print_exc()
            comp_q.put((call_idx, error))
            del item, payload


class _ActiveAsyncRequest(NamedTuple):
    idx: int
    async_caller: AsyncCaller
    async_request: AsyncRequest


class AsyncCallsQueue:
    """Schedules async requests and finalizes them in order once done on all ranks.

    Args:
        persistent: keep one worker process across saves (:class:`PersistentAsyncCaller`)
            instead of forking one per save.
    """

    def __init__(self, persistent: bool = False):
        self.async_calls: deque = deque()
        self.call_idx = -1
        self.persistent = persistent
        self.persistent_caller: Optional[PersistentAsyncCaller] = None

    def _get_async_caller(self) -> AsyncCaller:
        if not self.persistent:
            return TemporalAsyncCaller()
        if self.persistent_caller is None:
            self.persistent_caller = PersistentAsyncCaller()
        return self.persistent_caller

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Stage the data of ``async_request`` and start its write (call on all ranks).

        Returns the index of the call (as :meth:`maybe_finalize_async_calls` reports it).
        """
        self.call_idx += 1
        caller = self._get_async_caller()
        async_request = async_request._replace(call_idx=self.call_idx).freeze()
        caller.schedule_async_call(async_request)
        self.async_calls.append(_ActiveAsyncRequest(self.call_idx, caller, async_request))
        return self.call_idx

    def maybe_finalize_async_calls(self, blocking: bool = False,
                                   no_dist: bool = False) -> List[int]:
        """Finalize the calls that are done on all ranks (all of them with ``blocking``).

        Call on all ranks. Returns the finalized indices. When any rank's write failed, raises
        CheckpointingException on every rank without finalizing, except that a foreign
        request's (nvidia-resiliency-ext's) finalize functions run first, as in Megatron-Core.
        """
        finalized = []
        while self.async_calls:
            caller = self.async_calls[0].async_caller
            if not caller.is_current_async_call_done(blocking, no_dist):
                break
            call_idx, _, async_request = self.async_calls.popleft()
            try:
                self._raise_on_any_failure(call_idx, caller.take_failure(), no_dist)
            except CheckpointingException:
                foreign = not isinstance(async_request, AsyncRequest)
                for fn in async_request.finalize_fns if foreign else []:
                    fn()  # they check the write themselves and may raise their own error
                raise
            with debug_time("finalize", logger):
                for fn in async_request.finalize_fns:
                    fn()
                if not no_dist and group_initialized():
                    ten = torch.tensor([call_idx], dtype=torch.int, device=collective_device())
                    torch.distributed.all_reduce(ten, op=torch.distributed.ReduceOp.MAX)
                    if int(ten.item()) != call_idx:
                        raise CheckpointingException("Unmatched async calls: not all ranks "
                                                     "take part in async finalization")
            finalized.append(call_idx)
        return finalized

    @staticmethod
    def _raise_on_any_failure(call_idx: int, failure: Optional[str], no_dist: bool) -> None:
        """All-reduce of one failure flag per rank; raise on every rank if any is set."""
        failed = [int(failure is not None)]
        if not no_dist and group_initialized():
            dist = torch.distributed
            flags = torch.zeros(dist.get_world_size(), dtype=torch.int, device=collective_device())
            flags[dist.get_rank()] = failed[0]
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            failed = flags.tolist()
        if any(failed):
            ranks = [r for r, f in enumerate(failed) if f]
            raise CheckpointingException(
                f"Async checkpoint save {call_idx} failed on rank(s) {ranks}"
                + (f": {failure}" if failure else "") + "; the checkpoint is incomplete")

    def get_num_unfinalized_calls(self) -> int:
        """Number of scheduled calls not finalized yet."""
        return len(self.async_calls)

    def close(self, abort: bool = False) -> None:
        """Finalize every call (unless ``abort``) and end the worker processes."""
        try:
            if not abort:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            if abort:
                for _, caller, _ in self.async_calls:
                    caller.close(abort=True)
                self.async_calls.clear()
            if self.persistent_caller is not None:
                self.persistent_caller.close(abort=abort)
                self.persistent_caller = None
            release_staging_memory()
