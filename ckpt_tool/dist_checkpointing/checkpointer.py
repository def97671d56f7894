"""Checkpointer API modelled on PyTorch's experimental checkpointer
(``torch.distributed.checkpoint._experimental``), writing ``torch_dist`` checkpoints.

Same class and function names and semantics as PyTorch 2.13's experimental module, but the
files are Megatron-Core ``torch_dist`` checkpoints (see :mod:`._checkpoint_io` for how a state
dict of plain tensors, replicated over the ranks, or of ShardedTensors maps onto one). Every
call is collective: make it on every rank, in the same order.

Synchronous::

    ckpt = make_sync_checkpointer()
    ckpt.save(path, state_dict)                  # returns when the checkpoint is complete
    state_dict = ckpt.load(path, state_dict, strict=True)
    ckpt.close()

Asynchronous::

    ckpt = make_async_checkpointer()             # spawns one checkpoint process per rank
    stage_future, write_future = ckpt.save(path, state_dict)
    stage_future.result()   # staged: the live tensors may change from here on
    ...                     # training goes on; the write runs in the checkpoint process
    write_future.result()   # raises on every rank if the write failed anywhere
    ckpt.close()            # ends the processes, frees the shared memory

``save`` first waits for the previous write (re-raising its failure), then stages (into shared
memory reused across saves; with ``use_async_staging`` in a thread) and hands the staged state to
the checkpoint process. ``metadata.json`` is written only when every rank wrote its data, so a
failed or killed write leaves an incomplete directory (``ckpt validate`` says so). A checkpointer
whose write failed keeps failing: close it and make a new one.
"""

from __future__ import annotations

import abc
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from ._checkpoint_io import (
    PATHS_KEY,
    STATE_DICT,
    CheckpointReader,
    CheckpointWriter,
    CheckpointWriterConfig,
    RankInfo,
    WriterHook,
    default_rank_info,
    prepare_state_dict,
)
from ._checkpoint_process import CheckpointProcess, CheckpointProcessConfig, CheckpointProcessError
from ._staging import CheckpointStager, CheckpointStagerConfig, DefaultStager

__all__ = [
    "Checkpointer", "SyncCheckpointer", "AsyncCheckpointer", "CheckpointerConfig",
    "CheckpointWriter", "CheckpointWriterConfig", "WriterHook", "CheckpointReader",
    "CheckpointStager", "CheckpointStagerConfig", "DefaultStager", "CheckpointProcess",
    "CheckpointProcessConfig", "CheckpointProcessError", "RankInfo", "STATE_DICT", "PATHS_KEY",
    "make_sync_checkpointer", "make_async_checkpointer", "wrap_future", "prepare_state_dict",
]

logger = logging.getLogger(__name__)


def wrap_future(original_result: Any) -> Future:
    """A Future of None that completes when ``original_result`` (a Future or a value) does,
    with its exception if it fails."""
    masked: Future = Future()
    if isinstance(original_result, Future):
        def on_complete(f: Future) -> None:
            try:
                f.result()
                masked.set_result(None)
            except BaseException as e:
                masked.set_exception(e)

        original_result.add_done_callback(on_complete)
    else:
        masked.set_result(None)
    return masked


class Checkpointer(abc.ABC):
    """Saves and loads state dicts. Call order: ``save``/``load`` (any number), ``close``."""

    @abc.abstractmethod
    def save(self, path: str, state_dict: STATE_DICT,
             **kwargs: Any) -> Optional[Tuple[Future, Future]]:
        """Save ``state_dict`` to the directory ``path``.

        Returns None when synchronous, else ``(stage_future, write_future)``.
        """

    def load(self, path: str, state_dict: Optional[STATE_DICT] = None, *,
             default_map_location: Any = None, strict: bool = False,
             **kwargs: Any) -> STATE_DICT:
        """Load the checkpoint at ``path`` (synchronously, in both implementations).

        Args:
            path: the checkpoint directory.
            state_dict: what to load (its tensors are filled in place); None loads everything.
            default_map_location: device for the tensors of a load without ``state_dict``.
            strict: raise RuntimeError when keys of ``state_dict`` are not in the checkpoint.
        """
        loaded, missing = self._reader.read(path, state_dict,
                                            map_location=default_map_location, **kwargs)
        if strict and missing:
            raise RuntimeError(f"Checkpoint at {path} is missing keys: {missing}")
        return loaded

    @abc.abstractmethod
    def close(self) -> None:
        """Release the resources (processes, threads, shared memory)."""


class SyncCheckpointer(Checkpointer):
    """Writes in the calling process; ``save`` returns when the checkpoint is complete."""

    def __init__(self, writer: CheckpointWriter, reader: CheckpointReader):
        self._writer = writer
        self._reader = reader

    def save(self, path: str, state_dict: STATE_DICT, **kwargs: Any) -> None:
        self._writer.write(path, state_dict, **kwargs)
        return None

    def close(self) -> None:
        self._writer.close()


class AsyncCheckpointer(Checkpointer):
    """Stages in the training process, writes in a persistent checkpoint process per rank."""

    def __init__(self, checkpoint_stager: CheckpointStager, checkpoint_process: CheckpointProcess,
                 reader: CheckpointReader):
        self._reader = reader
        self._checkpoint_stager = checkpoint_stager
        self._checkpoint_process = checkpoint_process
        self._rank_info = getattr(reader, "_rank_info", None) or default_rank_info()
        self._write_future: Optional[Future] = None

    def save(self, path: str, state_dict: STATE_DICT, **kwargs: Any) -> Tuple[Future, Future]:
        """Wait for the previous write (raising its failure), stage, start the write.

        Returns ``(stage_future, write_future)``; once ``stage_future`` is done the live
        tensors may change. With synchronous staging it is done when ``save`` returns.
        """
        if self._write_future is not None:
            self._write_future.result()
        prepared = prepare_state_dict(state_dict, self._rank_info)
        staging_result = self._checkpoint_stager.stage(prepared, **kwargs)
        self._write_future = self._checkpoint_process.write(staging_result, path, **kwargs)
        return wrap_future(staging_result), self._write_future

    def close(self) -> None:
        """Wait for the pending write, end the checkpoint process, free the staging memory."""
        try:
            self._checkpoint_process.close()
        finally:
            self._checkpoint_stager.close()


@dataclass
class CheckpointerConfig:
    """Configuration of the components (PyTorch's; there is no barrier: the ``torch_dist``
    save synchronizes the ranks itself)."""

    writer_config: CheckpointWriterConfig = field(default_factory=CheckpointWriterConfig)
    staging_config: CheckpointStagerConfig = field(default_factory=CheckpointStagerConfig)
    process_config: CheckpointProcessConfig = field(default_factory=CheckpointProcessConfig)


def default_subprocess_init_fn(*_: Any) -> None:
    """Runs first in the checkpoint process (no-op)."""


def default_writer_init_fn(rank_info: RankInfo,
                           config: Optional[CheckpointWriterConfig] = None) -> CheckpointWriter:
    """Builds the checkpoint process's writer."""
    return CheckpointWriter(config=config, rank_info=rank_info)


def make_sync_checkpointer(config: Optional[CheckpointerConfig] = None,
                           rank_info: Optional[RankInfo] = None,
                           commit_hook: Optional[WriterHook] = None) -> SyncCheckpointer:
    """A :class:`SyncCheckpointer`; ``rank_info`` defaults to the default process group's."""
    config = config or CheckpointerConfig()
    rank_info = rank_info or default_rank_info()
    return SyncCheckpointer(CheckpointWriter(config.writer_config, rank_info, commit_hook),
                            CheckpointReader(rank_info))


def make_async_checkpointer(
    config: Optional[CheckpointerConfig] = None,
    rank_info: Optional[RankInfo] = None,
    subprocess_init_fn: Callable[..., None] = default_subprocess_init_fn,
    subprocess_init_args: tuple = (),
    checkpoint_writer_init_fn: Callable[..., CheckpointWriter] = default_writer_init_fn,
    checkpoint_writer_init_args: Optional[dict] = None,
) -> AsyncCheckpointer:
    """An :class:`AsyncCheckpointer` (collective: call on every rank).

    The init functions run in the checkpoint process and must be importable there (module
    level). ``checkpoint_writer_init_fn(rank_info=..., **checkpoint_writer_init_args)`` builds
    its writer; the default one gets ``config.writer_config``.
    """
    config = config or CheckpointerConfig()
    rank_info = rank_info or default_rank_info()
    writer_args = dict(checkpoint_writer_init_args or {})
    if checkpoint_writer_init_fn is default_writer_init_fn:
        writer_args.setdefault("config", config.writer_config)
    process = CheckpointProcess(rank_info, config.process_config, subprocess_init_fn,
                                subprocess_init_args, checkpoint_writer_init_fn, writer_args)
    return AsyncCheckpointer(DefaultStager(config.staging_config), process,
                             CheckpointReader(rank_info))
