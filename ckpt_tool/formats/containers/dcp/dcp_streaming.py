"""DCP machinery for the streaming ``torch_dist``/``dcp`` writers: a planner whose items come
from a target ``CheckpointMeta`` and whose data is pulled just in time, and a file writer that
holds one item at a time.

``torch.distributed.checkpoint.save`` runs the protocol (local plan, global plan with DCP's
validation, ``.metadata`` written last through ``.metadata.tmp`` + rename); these classes only
say what the items are and where their bytes come from. Each item is written by
:mod:`ckpt_tool.formats.containers.dcp.dcp_file_write` (the ``torch.save`` archive per item of the standard
``.distcp`` layout, byte for byte, written from the chunk's raw buffer).

Why not DCP's stock ``_write_files_from_queue``: it keeps every tensor it wrote to a file in a
dict until the file is closed (for its safetensors mode), so a file's whole content would be
in memory at once. :class:`StreamingFileSystemWriter` writes the same bytes and drops each
tensor as soon as it is on disk: peak ≈ ``threads`` × the largest chunk.
"""

from __future__ import annotations

import io
import math
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from torch.distributed.checkpoint import FileSystemWriter

from ckpt_tool.errors import CheckpointingException, CorruptCheckpointError
from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import check_grid as _check_grid
from ckpt_tool.formats.containers.dcp.dcp_torch_free_save import file_count
from ckpt_tool.formats.writer import WriteRequest, Writer
from ckpt_tool.model import TensorMeta

__all__ = ["McoreFileSystemWriter", "run_dcp_save", "tensor_items", "serialized",
           "item_nbytes", "chunk_write_items", "bytes_write_item", "StreamingSavePlanner",
           "StreamingFileSystemWriter"]


class McoreFileSystemWriter(FileSystemWriter):
    """DCP's writer, but with no empty files: ``__{rank}_{i}.distcp`` for non-empty buckets.

    Items are spread over ``thread_count`` files: objects round-robin, tensors largest first
    onto the least-filled file (by chunk bytes).
    """

    def write_data(self, plan: SavePlan, planner):
        buckets: List[List[WriteItem]] = [[] for _ in range(max(1, self.thread_count))]
        sizes = [0] * len(buckets)
        byte_items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        tensor_items = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
        for n, item in enumerate(byte_items):
            buckets[n % len(buckets)].append(item)

        def nbytes(item: WriteItem) -> int:
            td = item.tensor_data
            return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)

        for item in sorted(tensor_items, key=nbytes, reverse=True):
            target = sizes.index(min(sizes))
            buckets[target].append(item)
            sizes[target] += nbytes(item)

        import queue

        file_queue: queue.Queue = queue.Queue()
        for n, bucket in enumerate(b for b in buckets if b):
            name = f"{plan.storage_data.prefix}{n}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        fut = self._write_data(planner, file_queue)
        written = len(fut.wait())
        if written != len(plan.items):  # DCP loses the exceptions of its extra writer threads
            raise CheckpointingException(
                f"only {written} of {len(plan.items)} items written: a writer thread failed")
        return fut


def chunk_write_items(t: TensorMeta) -> List[WriteItem]:
    """One DCP SHARD item per target chunk of ``t`` (the whole tensor when it has none)."""
    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

    chunks = [(c.offsets, c.sizes) for c in t.chunks] or [((0,) * len(t.shape), t.shape)]
    if t.chunks:
        _check_grid(t)
    props = TensorProperties(dtype=torch_dtype(t.dtype))
    size = torch.Size(t.shape)
    return [WriteItem(
        index=MetadataIndex(t.key, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=props, size=size),
    ) for offsets, sizes in chunks]


def bytes_write_item(fqn: str) -> WriteItem:
    """A DCP bytes item (``BytesStorageMetadata``) under ``fqn``."""
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


class StreamingSavePlanner(DefaultSavePlanner):
    """Saves a fixed list of items whose data is resolved one item at a time.

    Args:
        items: the write items (see :func:`chunk_write_items`, :func:`bytes_write_item`).
        tensor: ``tensor(fqn, offsets, sizes)`` -> the chunk (contiguous CPU tensor, or a
            numpy array of its raw elements from a torch-free source).
        payload: ``payload(fqn)`` -> the serialized bytes item (``io.BytesIO``).
        planner_data: stored as ``Metadata.planner_data`` (None: as Megatron-Core writes).
        keep_local_plans: store ``Metadata.all_local_plans`` (Megatron-Core >= 0.11 does).
    """

    def __init__(self, items: List[WriteItem],
                 tensor: Callable[[str, Tuple[int, ...], Tuple[int, ...]], torch.Tensor],
                 payload: Callable[[str], io.BytesIO],
                 planner_data: Optional[Dict[str, Any]] = None, keep_local_plans: bool = False):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items = items
        self._tensor = tensor
        self._payload = payload
        self._planner_data = planner_data
        self._keep_local_plans = keep_local_plans

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(items=list(self.items), planner_data={})
        return self.plan

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        global_plans, metadata = super().create_global_plan(all_plans)
        if self._planner_data is not None:
            metadata.planner_data = dict(self._planner_data)
        if self._keep_local_plans:
            metadata.all_local_plans = list(all_plans)
        self.metadata = metadata
        return global_plans, metadata

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return self._payload(fqn)
        chunk = write_item.tensor_data.chunk
        sizes = tuple(chunk.sizes)
        data = self._tensor(fqn, tuple(chunk.offsets), sizes)
        want = write_item.tensor_data.properties.dtype
        if not isinstance(data, torch.Tensor) and hasattr(data, "itemsize"):
            # the raw elements from a torch-free source (a numpy array of unsigned ints)
            if tuple(data.shape) != sizes or data.itemsize != want.itemsize:
                raise CorruptCheckpointError(
                    f"tensor {fqn}: the source gave {data.itemsize}-byte elements "
                    f"{list(data.shape)} for the chunk at {list(chunk.offsets)}, expected "
                    f"{want} {list(sizes)}")
            return data if data.flags.c_contiguous else data.copy()
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != sizes \
                or data.dtype != want:
            got = (f"{data.dtype} {list(data.shape)}" if isinstance(data, torch.Tensor)
                   else type(data).__name__)
            raise CorruptCheckpointError(
                f"tensor {fqn}: the source gave {got} for the chunk at {list(chunk.offsets)}, "
                f"expected {want} {list(sizes)}")
        data = data.detach().cpu()
        if not data.is_contiguous() or data.untyped_storage().nbytes() != data.nbytes:
            data = data.contiguous().clone()  # torch.save writes whole storages, not views
        return data


class StreamingFileSystemWriter(McoreFileSystemWriter):
    """DCP's ``FileSystemWriter`` that holds one item per thread at a time.

    Items are spread over ``files`` data files ``__0_{i}.distcp`` (bytes items round-robin,
    tensors largest first onto the least-filled file, as :class:`McoreFileSystemWriter`
    does); ``threads`` files are written at once. ``on_written(item, nbytes)`` is called after
    each tensor item is on disk. ``digest``: the files' digests for the integrity manifest
    are computed while they are written (``ckpt_tool.digests``).
    """

    def __init__(self, path: str, *, files: int = 2, threads: int = 1,
                 on_written: Callable[[WriteItem, int], None] = lambda item, nbytes: None,
                 sync_files: bool = True,
                 file_of: Callable[[WriteItem], str | None] | None = None,
                 digest: str | None = None):
        super().__init__(path, thread_count=max(1, files), overwrite=False,
                         sync_files=sync_files)
        self.io_threads = max(1, threads)
        self.on_written = on_written
        self.file_of = file_of
        self.digest = digest
        self._lock = threading.Lock()

    def write_data(self, plan: SavePlan, planner):
        """With ``file_of``: every tensor item goes to the file it names (a reshard target
        rank's ``__{rank}_0.distcp``); bytes items join the first file. Else the default."""
        names = [self.file_of(i) if self.file_of else None for i in plan.items]
        tensor_names = [n for n, i in zip(names, plan.items) if i.type != WriteItemType.BYTE_IO]
        if not tensor_names or any(n is None for n in tensor_names):
            return super().write_data(plan, planner)
        import queue

        buckets: dict[str, list[WriteItem]] = {}
        for name, item in zip(names, plan.items):
            if item.type != WriteItemType.BYTE_IO:
                buckets.setdefault(name, []).append(item)
        first = sorted(buckets)[0]
        for name, item in zip(names, plan.items):
            if item.type == WriteItemType.BYTE_IO:
                buckets[name if name in buckets else first].append(item)
        file_queue: queue.Queue = queue.Queue()
        for name in sorted(buckets):
            file_queue.put((self.fs.concat_path(self.path, name), name, buckets[name]))
        return self._write_data(planner, file_queue)

    def storage_meta(self) -> StorageMeta:
        # a str like Megatron-Core records (DCP's own writer records a PosixPath)
        return StorageMeta(checkpoint_id=str(self.path), save_id=self.save_id)

    def _write_one_file(self, planner, path: str, storage_key: str,
                        items: Sequence[WriteItem]) -> list:
        from ckpt_tool.formats.containers.dcp.dcp_file_write import write_dcp_file

        def on_written(item: WriteItem, nbytes: int) -> None:
            with self._lock:
                self.on_written(item, nbytes)

        return write_dcp_file(path, storage_key, items, planner.resolve_data,
                              transforms=self.transforms,
                              serialization_format=self.serialization_format,
                              on_written=on_written, sync=self.sync_files,
                              digest=self.digest)

    def _write_data(self, planner, file_queue) -> Future:
        jobs = []
        while not file_queue.empty():
            jobs.append(file_queue.get_nowait())
        if self.io_threads == 1 or len(jobs) <= 1:
            parts = [self._write_one_file(planner, *job) for job in jobs]
        else:
            with ThreadPoolExecutor(self.io_threads, thread_name_prefix="ckpt-dcp-write") as ex:
                parts = list(ex.map(lambda job: self._write_one_file(planner, *job), jobs))
        fut: Future = Future()
        fut.set_result([r for part in parts for r in part])
        return fut


# -- running a streaming DCP save for a Writer (both DCP writers) --------------------

def serialized(value: Any) -> io.BytesIO:
    """``torch.save`` of ``value`` (stand-ins of classes not imported pickled back as what
    they stand for: ``safe_pickle.pickle_module_for``)."""
    import torch

    from ckpt_tool.formats.containers.pickle.safe_pickle import pickle_module_for

    buf = io.BytesIO()
    torch.save(value, buf, pickle_module=pickle_module_for(value))
    buf.seek(0)
    return buf


def run_dcp_save(writer: Writer, request: WriteRequest, items: list, planner_data,
                  keep_local_plans: bool,
                  tensor: Callable[[str, tuple, tuple], Any],
                  payload: Callable[[str], io.BytesIO]) -> None:
    """``dcp.save`` of ``items`` into ``writer.directory`` (original errors re-raised)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    chunk_files = {(k, tuple(c.offsets)): c.file for k, t in request.meta.tensors.items()
                   for c in t.chunks if c.file}

    def file_of(item: Any) -> str | None:
        if item.index.offset is None:
            return None
        return chunk_files.get((item.index.fqn, tuple(item.index.offset)))

    ranks = request.ranks
    distributed = ranks is not None and ranks.world > 1
    if distributed:  # each rank writes its share, balanced by bytes; rank 0 writes .metadata
        from ckpt_tool.parallel import split_by_bytes

        # items bound for one named file stay on one rank (two ranks never write one file)
        groups: dict[Any, list] = {}
        for n, i in enumerate(items):
            groups.setdefault(file_of(i) or n, []).append(i)
        share = split_by_bytes([(g, sum(item_nbytes(i) for i in groups[g])) for g in groups],
                               ranks.world)[ranks.rank]
        items = [i for g in share for i in groups[g]]
    planner = StreamingSavePlanner(items, tensor, payload, planner_data=planner_data,
                                   keep_local_plans=keep_local_plans)
    storage = StreamingFileSystemWriter(
        str(writer.directory), files=file_count(request, writer, len(items)),
        threads=int(writer.options.extra.get("threads", 1)),
        on_written=lambda item, nbytes: request.progress(nbytes),
        file_of=file_of if chunk_files else None,
        # the integrity manifest's algorithm (Megatron-Core's integrity.json: sha256)
        digest="sha256" if writer.format_name == "torch_dist" else "crc32")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=storage, planner=planner, no_dist=not distributed)
    except CheckpointException as exc:  # DCP wraps every failure (a BaseException)
        for original, _trace in exc.failures.values():
            raise original from None
        raise RuntimeError(str(exc)) from None


def item_nbytes(item: Any) -> int:
    """Bytes of a tensor write item (bytes items count as small)."""
    td = getattr(item, "tensor_data", None)
    if td is None:
        return 1
    return max(1, math.prod(td.chunk.sizes) * td.properties.dtype.itemsize)


def tensor_items(request: WriteRequest) -> list:
    items = []
    for t in request.meta.tensors.values():
        items += chunk_write_items(t)
    return items
