"""A DCP storage writer whose data write can run in a background process.

Call order (``state_dict_saver`` drives it)::

    writer = FileSystemWriterAsync(ckpt_dir, thread_count=2)
    ... DCP planning (set_up_storage_writer, prepare_local_plan, prepare_global_plan) ...
    writer.prepare_write_data(central_plan, planner)   # stages a private host copy
    fn, preload_fn, args = writer.get_save_function_and_args()
    fn(*args) with args[1] = preload_fn()                # anywhere: a forked/spawned worker
    results = writer.retrieve_write_results()          # back in the training process
    writer.finish(metadata, all_ranks_results)          # coordinator: writes .metadata

Staging copies every tensor into host memory leased from the process's staging pool (pinned
shared memory reused by the next save; see :mod:`.._staging_pool`): device copies are
non-blocking with one synchronisation at the end, so once ``prepare_write_data`` returns,
in-place updates of the live tensors cannot reach the files and no write reads device memory.
The lease goes back to the pool when the write results are retrieved (finalize).
Each bucket of items becomes one ``__{rank}_{i}.distcp`` file, written by its own thread and
fsynced. Results travel back through a small file in the temp directory, which works for forked
and spawned workers alike and needs no helper process.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import queue
import tempfile
import threading
import uuid
import weakref
from functools import partial
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import WRAPPED_EXCEPTION, _wrap_exception
from torch.distributed.checkpoint.filesystem import _StoragePrefix, _write_item
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckpt_tool._pause_points import pause_point
from ckpt_tool.integrity_manifest import digest_file

from .._staging_pool import exact_storage, staged_nbytes, staging_pool
from .._mcore_names import HAVE_PSUTIL  # noqa: F401 (re-exported as in MCore)
from ..core import CheckpointingException
from .async_utils import _disable_gc  # noqa: F401 (MCore's name here)

__all__ = ["FileSystemWriterAsync", "WriteBucket", "take_file_digests"]

# MCore keeps a process-wide Manager queue here for the results of its writer processes (and
# Megatron-LM's training code imports the name to shut it down). Ours passes each save's
# results through its own ResultsDrop, so this stays None.
_results_queue = None

# (file path, file name (storage key), ([(item, BytesIO)], [(item, CPU tensor)]))
WriteBucket = Tuple[str, str, Tuple[list, list]]


# {checkpoint directory: {data file name: (size, sha256)}} of this rank's last write there,
# left by ``retrieve_write_results`` for the integrity manifest (``take_file_digests``)
_DIGESTS: Dict[str, Dict[str, Tuple[int, str]]] = {}


def take_file_digests(checkpoint_dir: Union[str, os.PathLike]) -> Dict[str, Tuple[int, str]]:
    """``{file name: (size, sha256 hex)}`` of the data files this rank's last write into
    ``checkpoint_dir`` produced (computed by the writer, right after each file's fsync), once;
    empty when none is known."""
    return _DIGESTS.pop(os.path.abspath(os.fspath(checkpoint_dir)), {})


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _unlink_quietly(path: str) -> None:
    for p in (path, path + ".tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


class ResultsDrop:
    """A one-shot, queue-like channel from a worker process: ``put`` once, ``get_nowait``.

    Backed by a file (written to a temp name, then renamed), so it is picklable to any worker
    and an absent answer (a killed worker) reads as :class:`queue.Empty`.
    """

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.gettempdir(),
                                 f"ckpt_async_{os.getpid()}_{uuid.uuid4().hex}.results")

    def put(self, obj: Any) -> None:
        with open(self.path + ".tmp", "wb") as f:
            pickle.dump(obj, f)
        os.replace(self.path + ".tmp", self.path)

    def get_nowait(self) -> Any:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise queue.Empty from None
        os.unlink(self.path)
        return pickle.loads(data)  # written by our own worker into our private file


def _get_write_results_queue() -> "ResultsDrop":
    """A channel for one save's write results (MCore's name; ours: a fresh ResultsDrop)."""
    return ResultsDrop()


def _process_memory() -> int:
    """Resident memory of this process in bytes (0 without psutil)."""
    if not HAVE_PSUTIL:
        return 0
    import psutil

    return psutil.Process().memory_info().rss


def _write_bucket(transform_list: list, write_bucket: WriteBucket, use_fsync: bool
                  ) -> List[WriteResult]:
    """Write one bucket to its file (objects first, then tensors); fsync it with use_fsync."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    path, storage_key, (bytes_data, tensor_data) = write_bucket
    out = []
    with open(path, "wb") as stream:
        for item, data in chain(bytes_data, tensor_data):
            if isinstance(data, torch.Tensor):  # a view into a staging segment
                data = exact_storage(data)
            out.append(_write_item(*transform_list, stream, data, item, storage_key,
                                   serialization_format=SerializationFormat.TORCH_SAVE))
        if use_fsync:
            stream.flush()
            os.fsync(stream.fileno())
    pause_point("save-file-written")
    return out


def _item_size(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * torch._utils._element_size(td.properties.dtype)


def _split_by_size_and_type(bins: int, items: List[WriteItem]) -> List[List[WriteItem]]:
    """Objects round-robin, tensors largest first onto the least-filled bin (by bytes)."""
    buckets: List[List[WriteItem]] = [[] for _ in range(max(1, bins))]
    sizes = [0] * len(buckets)
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = [i for i in items if i.type != WriteItemType.BYTE_IO]
    for n, item in enumerate(byte_items):
        buckets[n % len(buckets)].append(item)
    for item in sorted(tensor_items, key=_item_size, reverse=True):
        target = sizes.index(min(sizes))
        buckets[target].append(item)
        sizes[target] += _item_size(item)
    return buckets


def _split_by_separation_hint(buckets: List[List[WriteItem]], hint: Optional[str]
                              ) -> List[Tuple[str, List[WriteItem]]]:
    """``(file name prefix, bucket)`` pairs: without ``hint`` the buckets as they are; with it
    each bucket split in two, the items whose key does not start with ``hint`` first (prefix
    ``""``), then, in files named ``{hint}__R_N.distcp``, those whose key does."""
    if hint is None:
        return [("", b) for b in buckets]
    rest = [("", [i for i in b if not i.index.fqn.startswith(hint)]) for b in buckets]
    hinted = [(hint, [i for i in b if i.index.fqn.startswith(hint)]) for b in buckets]
    return rest + hinted


# Megatron-Core's strategies ask for the msc writer only when MultiStorageClientFeature is
# enabled, which ours never is: save() takes msc:// paths itself (spool, then upload)
_NO_MSC_WRITER = ("the multi-storage client writer (use_msc=True) is not used here: pass the "
                  "msc:// path to dist_checkpointing.save, which writes it "
                  "(docs/object-storage.md)")

class FileSystemWriterAsync(FileSystemWriter):
    """DCP's file writer split into staging (here) and writing (in a worker).

    One writer serves one save. ``write_data`` is not supported: use
    :meth:`prepare_write_data` and :meth:`get_save_function_and_args`.
    """

    def __init__(self, path: Union[str, os.PathLike], *args, separation_hint: Optional[str] = None,
                 use_msc: bool = False, **kwargs):
        if use_msc:
            raise CheckpointingException(_NO_MSC_WRITER)
        super().__init__(path, *args, **kwargs)
        if separation_hint is not None and self.thread_count < 2:
            raise CheckpointingException(
                "thread_count must be at least 2 if separation_hint is provided")
        self.separation_hint = separation_hint
        self.checkpoint_dir = str(path)
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue: Optional[ResultsDrop] = None
        self._lease = self._lease_finalizer = None
        self.stage_host_tensors = True  # False: host tensors are written from where they are
        # each rank may make its own global plan (prepare_decentralized_global_plan)
        self.can_run_decentralized_global_plan = True

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Split ``plan``'s items into per-file buckets and stage their data to host memory."""
        prefix = plan.storage_data.prefix
        hint = self.separation_hint
        bins = self.thread_count // 2 if hint is not None else self.thread_count
        grouped, tensors = [], []  # tensors: those to stage, in bucket order
        for group, bucket in _split_by_separation_hint(_split_by_size_and_type(bins, plan.items),
                                                       hint):
            if not bucket:
                continue
            bytes_data, tensor_items = [], []
            for item in bucket:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    bytes_data.append((item, io.BytesIO(data.getvalue())))
                elif not self.stage_host_tensors and data.device.type == "cpu":
                    tensor_items.append((item, data))
                else:
                    tensor_items.append((item, None))
                    tensors.append(data)
            grouped.append((group, bytes_data, tensor_items))
        self._release_staging()
        if tensors:
            self._lease = staging_pool().lease(
                staged_nbytes(tensors), pin=any(t.device.type == "cuda" for t in tensors))
            self._lease_finalizer = weakref.finalize(self, self._lease.release)
        host = iter(self._lease.copy_in(tensors) if tensors else ())
        self.write_buckets = []
        for group, bytes_data, tensor_items in grouped:
            tensor_data = [(item, next(host) if data is None else data)
                           for item, data in tensor_items]
            name = f"{group}{prefix}{len(self.write_buckets)}.distcp"
            self.write_buckets.append((os.path.join(self.checkpoint_dir, name), name,
                                       (bytes_data, tensor_data)))
        if self.write_buckets:
            self.results_queue = ResultsDrop()
            weakref.finalize(self, _unlink_quietly, self.results_queue.path)
        else:
            self.results_queue = None

    def _release_staging(self) -> None:
        """Give the staging memory back to the pool (the write no longer reads it)."""
        if self._lease_finalizer is not None:
            self._lease_finalizer()
        self._lease = self._lease_finalizer = None

    def get_save_function_and_args(self) -> Tuple[Optional[Callable], Optional[Callable], List]:
        """``(save_fn, preload_fn, args)``; ``(None, None, [])`` when this rank writes nothing.

        ``save_fn(*args)`` with ``args[1] = preload_fn()`` writes the staged buckets.
        """
        if not self.write_buckets:
            return None, None, []
        return (partial(self.write_preloaded_data_multiproc, [self.transforms], False),
                partial(self.preload_tensors, self.write_buckets, True),
                [_rank(), self.write_buckets, self.results_queue])

    @staticmethod
    def preload_tensors(write_buckets: List[WriteBucket], non_blocking: bool = True
                        ) -> List[WriteBucket]:
        """The buckets with every tensor on the host (staged tensors already are)."""
        out = []
        for path, name, (bytes_data, tensor_data) in write_buckets:
            tensor_data = [(item, t.to("cpu", non_blocking=non_blocking))
                           for item, t in tensor_data]
            out.append((path, name, (bytes_data, tensor_data)))
        if non_blocking and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return out

    @staticmethod
    def write_preloaded_data_multiproc(transform_list: list, use_msc: bool, rank: int,
                                       write_buckets: List[WriteBucket],
                                       global_results_queue: ResultsDrop) -> None:
        """Write every bucket (one thread each) and put ``({bucket: [WriteResult]}, {file name:
        (size, sha256)})`` or the first exception into ``global_results_queue``."""
        if use_msc:
            raise CheckpointingException(_NO_MSC_WRITER)
        digests: Dict[str, Tuple[int, str]] = {}
        local_results: "queue.Queue" = queue.Queue()
        count_queue: "queue.Queue" = queue.Queue()  # one token per bucket, as MCore's workers
        for i in range(len(write_buckets)):
            count_queue.put(i)

        def work(i: int, bucket: WriteBucket) -> None:
            try:  # looked up at call time: tests replace it to inject failures
                FileSystemWriterAsync.write_preloaded_data(
                    transform_list, i, bucket, local_results, count_queue, True,
                    use_msc=use_msc)
                # the integrity manifest's digest, read back while the file is in cache
                digests[os.path.basename(bucket[0])] = digest_file(bucket[0], "sha256")
            except BaseException as e:  # reported below, never lost in a thread
                local_results.put((i, e))

        threads = [threading.Thread(target=work, args=(i, b), daemon=True)
                   for i, b in enumerate(write_buckets)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results: Dict[int, Any] = {}
        while not local_results.empty():
            i, result = local_results.get_nowait()
            results.setdefault(i, result)
        errors = [(i, r) for i, r in sorted(results.items()) if isinstance(r, BaseException)]
        if errors:
            i, err = errors[0]
            global_results_queue.put(RuntimeError(f"rank {rank}, writer {i}: {err!r}"))
        else:
            global_results_queue.put((results, digests))

    @staticmethod
    def write_preloaded_data(transform_list: list, local_proc_idx: int, write_bucket: WriteBucket,
                             results_queue: Any, count_queue: Any, use_fsync: bool,
                             **kwargs: Any) -> None:
        """Write one bucket to its file (objects first, then tensors; fsynced with
        ``use_fsync``); put ``(local_proc_idx, [WriteResult])``, or the exception, into
        ``results_queue``; then take one token off ``count_queue`` (MCore's protocol)."""
        try:
            results_queue.put((local_proc_idx,
                               _write_bucket(transform_list, write_bucket, use_fsync)))
        except Exception as e:  # the caller reports it with the rank
            results_queue.put((local_proc_idx, e))
        finally:
            count_queue.get()
            count_queue.task_done()

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global-plan step of a decentralized save (each rank plans alone): this rank's
        plan with its file prefix, as the coordinator would have given it."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank}_"))

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        raise NotImplementedError("FileSystemWriterAsync writes via get_save_function_and_args")

    def retrieve_write_results(self) -> Union[List[WriteResult], WRAPPED_EXCEPTION]:
        """This rank's write results, or a wrapped exception when its write failed or no
        result came back (a dead worker)."""
        if self.write_buckets is None:
            return _wrap_exception(RuntimeError("prepare_write_data was not called"))
        try:
            return self._collect_results()
        finally:
            self._release_staging()

    def _collect_results(self) -> Union[List[WriteResult], WRAPPED_EXCEPTION]:
        if self.results_queue is None:
            return []
        try:
            results = self.results_queue.get_nowait()
        except queue.Empty:
            return _wrap_exception(RuntimeError(
                "No write results: the async checkpoint worker did not finish (killed?)"))
        except Exception as e:
            return _wrap_exception(RuntimeError(f"Unreadable write results: {e!r}"))
        if isinstance(results, BaseException):
            failure = RuntimeError(f"Worker failure: {results}")
            failure.__cause__ = results
            return _wrap_exception(failure)
        if isinstance(results, tuple):
            results, digests = results
            _DIGESTS[os.path.abspath(self.checkpoint_dir)] = dict(digests)
        if len(results) != len(self.write_buckets):
            return _wrap_exception(RuntimeError(
                f"Incomplete worker results (expected {len(self.write_buckets)}, got "
                f"{len(results)})"))
        return list(chain.from_iterable(results[i] for i in sorted(results)))

    @property
    def checkpoint_id(self) -> str:
        return self.checkpoint_dir
