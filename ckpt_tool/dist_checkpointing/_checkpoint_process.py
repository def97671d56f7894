"""The persistent checkpoint process of :class:`~.checkpointer.AsyncCheckpointer`.

Each training rank spawns one process that lives across saves. The processes of all ranks form
their own gloo process group (rendezvous through the training job's TCPStore under a fresh
prefix, or a store hosted by rank 0 when the job has none), so the collectives of a
``torch_dist`` save (planning, ``.metadata``, ``metadata.json``) never touch the training
group. Staged state dicts arrive as :func:`~._staging.dumps_staged` payloads (tensors stay in
shared memory). Call order, on every rank::

    process = CheckpointProcess(rank_info, config, init_fn, (), writer_init_fn, {})  # collective
    future = process.write(staged_or_future, path)   # returns at once; runs in a thread
    future.result()                                  # raises if the write failed on any rank
    process.close()

A write that fails anywhere fails on every rank: a failing process reports its error and exits,
which breaks the group, so its peers' collectives fail too; a killed process is noticed as a
closed pipe. After a failure the process is gone: close the checkpointer and make a new one.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist

from ._staging import SharedSegment, dumps_staged, loads_staged

__all__ = ["CheckpointProcessConfig", "CheckpointProcess"]

logger = logging.getLogger(__name__)

Rendezvous = Optional[Tuple[str, int, str]]  # (store host, store port, key prefix)


@dataclass
class CheckpointProcessConfig:
    """Timeouts of the checkpoint process.

    Attributes:
        subprocess_init_timeout_secs: how long the first write waits for the process to start.
        subprocess_shutdown_timeout_secs: how long ``close`` waits before killing it.
        collective_timeout_secs: timeout of the processes' own gloo group.
    """

    subprocess_init_timeout_secs: int = 300
    subprocess_shutdown_timeout_secs: int = 60
    collective_timeout_secs: int = 600


class CheckpointProcessError(RuntimeError):
    """A background checkpoint write failed (on this rank or, through the group, another)."""


def _root_store(store: Any) -> Any:
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def make_rendezvous(rank: int, world_size: int) -> Tuple[Rendezvous, Any]:
    """Where the checkpoint processes meet: ``((host, port, prefix), store_to_keep_alive)``.

    Collective over the default group when it has more than one rank; ``(None, None)`` else.
    """
    if world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None, None
    keep = None
    info = [None]
    if rank == 0:
        root = _root_store(dist.distributed_c10d._get_default_store())
        if isinstance(root, dist.TCPStore):
            host, port = root.host, root.port
        else:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            keep = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = keep.port
        info = [(host, port, f"ckpt_tool/checkpointer/{uuid.uuid4().hex}/")]
    dist.broadcast_object_list(info, src=0)
    return info[0], keep


def _init_group(rdzv: Rendezvous, rank: int, world_size: int, timeout_s: int) -> None:
    if rdzv is None:
        return
    host, port, prefix = rdzv
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=world_size, timeout=timeout)


def _child_main(conn, rank: int, world_size: int, rdzv: Rendezvous, timeout_s: int,
                init_fn: Callable, init_args: tuple, writer_init_fn: Callable,
                writer_init_args: Dict[str, Any]) -> None:
    """Body of the checkpoint process: serve write requests until ``exit`` (or EOF)."""
    segments: Dict[str, SharedSegment] = {}

    def attach(path: str, nbytes: int) -> SharedSegment:
        if path not in segments:
            segments[path] = SharedSegment.attach(path, nbytes)
        return segments[path]

    try:
        init_fn(*init_args)
        _init_group(rdzv, rank, world_size, timeout_s)
        writer = writer_init_fn(**writer_init_args)
        conn.send(("ok", os.getpid()))
        while True:
            request = conn.recv()
            if request[0] == "exit":
                conn.send(("ok", None))
                break
            _, path, payload, kwargs = request
            used = set()
            state_dict = loads_staged(payload, lambda p, n: used.add(p) or attach(p, n))
            del payload
            for old in set(segments) - used:  # replaced by a larger one
                segments.pop(old).close()
            conn.send(("ok", None))  # attached: the training process may unlink the files
            writer.write(path, state_dict, **kwargs)
            del state_dict
            conn.send(("ok", None))
        writer.close()
        for seg in segments.values():
            seg.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as e:
        text = f"rank {rank}: {e!r}\n{traceback.format_exc()}"
        try:
            conn.send(("error", text))
        except OSError:
            pass
        sys.stderr.write(text)
        sys.stderr.flush()
        os._exit(1)  # drops this rank's gloo connections: peers' collectives fail at once


class CheckpointProcess:
    """One checkpoint process per rank (see the module docstring). Construct on every rank."""

    def __init__(self, rank_info: Any, config: CheckpointProcessConfig,
                 subprocess_init_fn: Callable[..., None], subprocess_init_args: tuple,
                 checkpoint_writer_init_fn: Callable[..., Any],
                 checkpoint_writer_init_args: Dict[str, Any]):
        self._rank_info = rank_info
        self._config = config
        self._rdzv, self._store = make_rendezvous(rank_info.global_rank,
                                                  rank_info.global_world_size)
        writer_args = dict(checkpoint_writer_init_args)
        writer_args.setdefault("rank_info", rank_info)
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, daemon=True, name=f"ckpt-writer-{rank_info.global_rank}",
            args=(child_conn, rank_info.global_rank, rank_info.global_world_size, self._rdzv,
                  config.collective_timeout_secs, subprocess_init_fn, subprocess_init_args,
                  checkpoint_writer_init_fn, writer_args))
        self.process.start()
        child_conn.close()  # so a dead child reads as EOF here
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
        self.process_creation_future = self._executor.submit(self._wait_started)

    @property
    def pid(self) -> Optional[int]:
        """Process id of the checkpoint process."""
        return self.process.pid if self.process is not None else None

    def _died(self, during: str) -> CheckpointProcessError:
        self.process.join(timeout=5)
        return CheckpointProcessError(
            f"rank {self._rank_info.global_rank}: checkpoint process (pid {self.process.pid}) "
            f"died with exit code {self.process.exitcode} during {during}")

    def _recv(self, during: str, timeout: Optional[float] = None) -> Any:
        try:
            if timeout is not None and not self._conn.poll(timeout):
                raise CheckpointProcessError(
                    f"rank {self._rank_info.global_rank}: no answer from the checkpoint "
                    f"process within {timeout}s during {during}")
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(during) from None
        if status != "ok":
            raise CheckpointProcessError(f"checkpoint write failed: {value}")
        return value

    def _wait_started(self) -> None:
        self._recv("start-up", timeout=self._config.subprocess_init_timeout_secs)

    def write(self, state_dict: Any, path: str, **kwargs: Any) -> Future:
        """Send the staged state dict (or a Future of it) to the process; a Future of the write.

        The Future raises :class:`CheckpointProcessError` if the write failed on any rank.
        """
        return self._executor.submit(self._write, state_dict, str(path), kwargs)

    def _write(self, state_dict: Any, path: str, kwargs: Dict[str, Any]) -> None:
        self.process_creation_future.result()
        if isinstance(state_dict, Future):
            state_dict = state_dict.result()
        payload, segments = dumps_staged(state_dict)
        del state_dict
        try:
            self._conn.send(("write", path, payload, kwargs))
        except OSError:
            raise self._died(f"the write of {path}") from None
        self._recv(f"the write of {path}")  # the process has mapped the staged memory
        for seg in segments:  # from now on no crash can leave the memory behind
            seg.unlink()
        self._recv(f"the write of {path}")

    def close(self) -> None:
        """Wait for the pending write, stop the process (kill it after the shutdown timeout)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self._conn.send(("exit",))
                self._recv("shutdown", timeout=self._config.subprocess_shutdown_timeout_secs)
            except (BrokenPipeError, ConnectionError, EOFError):
                pass  # it ended on its own (a failed write ends it): nothing to stop
            except CheckpointProcessError as e:
                logger.warning("%s", e)
            self.process.join(timeout=self._config.subprocess_shutdown_timeout_secs)
            if self.process.is_alive():
                logger.warning("checkpoint process %d did not exit; killing it", self.process.pid)
                self.process.kill()
        self.process.join()
        self.process.close()
        self.process = None
        self._conn.close()
        self._store = None
