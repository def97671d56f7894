"""A DCP save without DCP: the ``.distcp`` files and ``.metadata`` written by us.

What ``torch.distributed.checkpoint.save`` does with the streaming writers of
:mod:`ckpt_tool.formats.containers.dcp.dcp_streaming`, in one process or on every rank of a torchrun job
(each rank's local plan as the DCP path splits the items, its own ``__{rank}_{i}.distcp``
files; rank 0 gathers what every rank wrote and writes ``.metadata``), step by step, but
without DCP's per-item protocol nor, in one process, importing torch (seconds of CPU, most
of a small conversion): the plan and the ``Metadata`` come from
:mod:`ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata`, each tensor item is the ``torch.save`` archive of
its chunk (:class:`ckpt_tool.formats.containers.torch_zip.torch_zip_write.TensorArchive`), each bytes item its
payload as given, every file fsynced, its digest computed while it is written
(``ckpt_tool.digests``), then ``.metadata`` through ``.metadata.tmp`` + rename, as DCP does.
The files are byte for byte what the DCP path writes; ``.metadata`` unpickles (with torch)
into an equal ``Metadata`` (its ``save_id`` is a fresh UUID, as DCP's).

:func:`torch_free_save_applies` says when this path can be taken: every chunk one the raw archive
writer covers (its dtype has a plain storage class, under 4 GiB).
"""

from __future__ import annotations

import math
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from ckpt_tool.errors import CheckpointingException, CorruptCheckpointError
from ckpt_tool.digests import digested_file
from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import (
    PlannedItem,
    assign_files,
    metadata_pickle,
    planned_items,
    rank_plans,
)
from ckpt_tool.formats.containers.torch_zip.torch_zip_write import (STORAGE_TYPES, TensorArchive,
                                                                    supported)
from ckpt_tool.formats.writer import WriteRequest, Writer, WriterOptions
from ckpt_tool.model import CheckpointMeta, dtype_itemsize

__all__ = ["torch_free_save_applies", "torch_free_dcp_save", "chunk_buffer", "file_count", "is_main_rank",
           "stored_shape_note", "torch_free_write_applies", "torch_free_write"]

METADATA_FILE = ".metadata"


def torch_free_save_applies(items: Sequence[PlannedItem]) -> bool:
    """True when every tensor item can be written by the raw archive writer."""
    return all(i.is_bytes or supported(i.dtype, i.nbytes) for i in items)


def chunk_buffer(item: PlannedItem, data: Any) -> memoryview:
    """The raw bytes of ``data`` (a numpy array of the chunk's elements as unsigned ints, or
    a CPU torch tensor of the item's dtype) after checking its shape and element size."""
    shape = tuple(int(s) for s in getattr(data, "shape", ()))
    if hasattr(data, "element_size"):  # a torch tensor (the source imported torch)
        got = f"{str(data.dtype).removeprefix('torch.')} {list(shape)}"
        ok = shape == item.sizes and got.split(" ")[0] == item.dtype
        if ok:
            data = data.detach().cpu().contiguous()
            from ckpt_tool.formats.write_pieces import tensor_bytes

            return tensor_bytes(data) if data.numel() else memoryview(b"")
    elif hasattr(data, "itemsize"):
        import numpy as np

        got = f"{data.itemsize}-byte elements {list(shape)}"
        if shape == item.sizes and data.itemsize == dtype_itemsize(item.dtype):
            return memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    else:
        got = type(data).__name__
    raise CorruptCheckpointError(
        f"tensor {item.fqn}: the source gave {got} for the chunk at {list(item.offsets or ())}, "
        f"expected {item.dtype} {list(item.sizes)}")


def _write_file(path: Path, items: Sequence[PlannedItem], tensor: Callable[[PlannedItem], Any],
                payload: Callable[[str], bytes], on_written: Callable[[int], None], *,
                sync: bool, digest: str | None) -> list[tuple[int, int]]:
    """Write ``items`` into the new file ``path``; ``(offset, length)`` of each."""
    out = []
    with digested_file(path, digest, sync=sync) as f:
        for item in items:
            offset = f.position
            if item.is_bytes:
                length = f.write(payload(item.fqn))
            else:
                data = chunk_buffer(item, tensor(item))
                archive = TensorArchive(item.dtype, item.sizes, data.nbytes)
                length = archive.write(f.write, data, writev=f.writev, with_crcs=True)
                del data  # on disk: let it go before resolving the next item
                on_written(item.nbytes)
            out.append((offset, length))
            f.advanced()  # what has reached the OS so far
    return out


def torch_free_dcp_save(directory: Path, items: Sequence[PlannedItem], *,
                 tensor: Callable[[PlannedItem], Any], payload: Callable[[str], bytes],
                 files: int | Callable[[int], int], threads: int = 1,
                 file_of: Callable[[PlannedItem], str | None] | None = None,
                 on_written: Callable[[int], None] = lambda nbytes: None,
                 planner_data: Any = None, keep_local_plans: bool = True,
                 digest: str | None = None, sync: bool = True, ranks: Any = None,
                 prepare: Callable[[], None] | None = None) -> None:
    """Save ``items`` into ``directory`` as DCP's saving processes would (see the module
    docstring): ``tensor(item)`` gives a chunk's data, ``payload(fqn)`` a bytes item's
    bytes; ``files`` data files (or ``files(number of this rank's items)``; or the files
    ``file_of`` names), ``threads`` at once.

    ``ranks`` (``ckpt_tool.parallel.Ranks``, world > 1): every rank calls this with the same
    arguments and writes its local plan (:func:`rank_plans`) into ``__{rank}_{i}.distcp``;
    rank 0 gathers what each wrote and writes ``.metadata``. A failure on any rank (also in
    ``prepare``, run first on this rank) fails every rank once all have met, as DCP does."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    world = 1 if ranks is None else int(ranks.world)
    rank = 0 if ranks is None else int(ranks.rank)
    plans = rank_plans(items, world, file_of)
    items = [i for plan in plans for i in plan]  # the global plan: the local ones in rank order
    if world == 1:
        if prepare is not None:
            prepare()
        written = _write_plan(directory, plans[0], rank, tensor, payload, files, threads,
                              file_of, on_written, digest, sync)
        _write_metadata(directory, items, written, plans, planner_data, keep_local_plans,
                        sync)
        return
    position = {item: n for n, item in enumerate(items)}
    error: BaseException | None = None
    mine: list[tuple[int, str, int, int]] | None = None
    try:
        if prepare is not None:
            prepare()
        mine = [(position[i], name, offset, length) for i, name, offset, length in _write_plan(
            directory, plans[rank], rank, tensor, payload, files, threads, file_of,
            on_written, digest, sync)]
    except Exception as exc:  # noqa: BLE001 - met by every rank below, then raised
        error = exc
    parts = ranks.gather(None if error is not None else mine)
    status = None
    if ranks.is_main:
        failed = [r for r, part in enumerate(parts or []) if part is None]
        if failed:
            status = f"rank {failed[0]} failed writing its data files"
        else:
            try:
                written = [(items[n], name, offset, length)
                           for part in parts for n, name, offset, length in part]
                _write_metadata(directory, items, written, plans, planner_data,
                                keep_local_plans, sync)
            except Exception as exc:  # noqa: BLE001
                error = exc
                status = f"rank 0 failed writing {METADATA_FILE}: {exc}"
    status = ranks.broadcast(status)
    if error is not None:
        raise error
    if status is not None:
        raise CheckpointingException(f"{status} (see that rank's error)")


def _write_plan(directory: Path, plan: Sequence[PlannedItem], rank: int,
                tensor: Callable[[PlannedItem], Any], payload: Callable[[str], bytes],
                files: int | Callable[[int], int], threads: int,
                file_of: Callable[[PlannedItem], str | None] | None,
                on_written: Callable[[int], None], digest: str | None,
                sync: bool) -> list[tuple[PlannedItem, str, int, int]]:
    """One rank's data files; ``(item, file, offset, length)`` in file (job) order."""
    count = files(len(plan)) if callable(files) else files
    jobs = assign_files(plan, count, prefix=f"__{rank}_", file_of=file_of)

    def one(job: tuple[str, list[PlannedItem]]) -> list[tuple[PlannedItem, str, int, int]]:
        name, file_items = job
        spans = _write_file(directory / name, file_items, tensor, payload, on_written,
                            sync=sync, digest=digest)
        return [(i, name, o, n) for i, (o, n) in zip(file_items, spans)]

    if threads <= 1 or len(jobs) <= 1:
        parts = [one(job) for job in jobs]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-dcp-write") as ex:
            parts = list(ex.map(one, jobs))
    return [w for part in parts for w in part]


def _write_metadata(directory: Path, items: Sequence[PlannedItem],
                    written: Sequence[tuple[PlannedItem, str, int, int]],
                    plans: Sequence[Sequence[PlannedItem]], planner_data: Any,
                    keep_local_plans: bool, sync: bool) -> None:
    data = metadata_pickle(items, written, checkpoint_id=str(directory),
                           save_id=str(uuid.uuid4()), planner_data=planner_data,
                           keep_local_plans=keep_local_plans, plans=plans)
    tmp = directory / f"{METADATA_FILE}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, directory / METADATA_FILE)


# -- a writer's request on the raw path (torch_dist and dcp writers) -----------------

def torch_free_write_applies(meta: CheckpointMeta, options: WriterOptions) -> bool:
    """True when a writer with ``options`` should write the target ``meta`` through
    :func:`torch_free_dcp_save`: every target chunk suits the raw archive writer and
    ``extra["raw_save"]`` is not False."""
    if options.extra.get("raw_save", True) is False:
        return False
    for t in meta.tensors.values():  # the largest item of each tensor (not every item)
        if t.dtype not in STORAGE_TYPES:
            return False
        largest = max((math.prod(c.sizes) for c in t.chunks), default=math.prod(t.shape))
        if not supported(t.dtype, largest * dtype_itemsize(t.dtype)):
            return False
    return True


def torch_free_write(writer: Writer, request: WriteRequest, bytes_keys: Sequence[str],
              payload: Callable[[str], bytes], *, planner_data: Any, keep_local_plans: bool,
              digest: str, prepare: Callable[[], None] | None = None) -> None:
    """:func:`torch_free_dcp_save` of ``request`` into ``writer.directory`` on this rank (every rank
    of a torchrun job calls it): the target chunks then the bytes items ``bytes_keys``
    (``payload(key)``: their bytes), the files and threads the writer's options ask for,
    each chunk into the file the target names when it names one."""
    ranks = request.ranks if request.ranks is not None and request.ranks.world > 1 \
        else None
    chunk_files = {(k, tuple(c.offsets)): c.file for k, t in request.meta.tensors.items()
                   for c in t.chunks if c.file}
    torch_free_dcp_save(
        writer.directory, planned_items(list(request.meta.tensors.values()), bytes_keys),
        payload=payload, tensor=lambda i: request.source.read(i.fqn, i.offsets, i.sizes),
        files=lambda n: file_count(request, writer, n),
        threads=int(writer.options.extra.get("threads", 1)),
        file_of=(lambda i: chunk_files.get((i.fqn, i.offsets))) if chunk_files else None,
        on_written=request.progress, planner_data=planner_data,
        keep_local_plans=keep_local_plans, digest=digest, ranks=ranks, prepare=prepare)


# -- shared with the DCP path (dcp_streaming) ----------------------------------------

def file_count(request: WriteRequest, writer: Writer, items: int) -> int:
    files = writer.options.extra.get("files")
    if files is None:
        total = request.meta.total_bytes
        files = max(2, math.ceil(total / max(1, writer.options.max_shard_size)),
                    int(writer.options.extra.get("threads", 1)))  # a file per thread at least
    return max(1, min(int(files), max(1, items)))


def is_main_rank(request: WriteRequest) -> bool:
    return request.ranks is None or request.ranks.is_main


def stored_shape_note(request: WriteRequest) -> list[str]:
    keys = sorted(k for k, t in request.meta.tensors.items() if t.stored_shape is not None)
    if not keys:
        return []
    return [f"wrote {len(keys)} tensor{'s' * (len(keys) != 1)} in their logical shape, not the "
            f"N-D reformulated "
            f"flattened layout of the source ({keys[0]}{', ...' if len(keys) > 1 else ''})"]
