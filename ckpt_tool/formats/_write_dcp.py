"""Streaming writers of Megatron-Core ``torch_dist`` and plain PyTorch DCP checkpoints.

Both run ``torch.distributed.checkpoint.save`` in this one process (no process group) with the
planner and file writer of :mod:`._write_dcp_io`: every target chunk
(``meta.tensors[key].chunks[i]``) becomes exactly one DCP item, pulled from
``request.source`` when the file writer reaches it and dropped once written, so peak memory is
about the largest chunk (times ``threads``), never the checkpoint.

``torch_dist`` (what Megatron-Core 0.16.1 writes for one saving rank): ``common.pt``
(``torch.save`` of the common state), ``__0_{i}.distcp`` data files, ``.metadata``
(``Metadata`` with ``planner_data=None`` and ``all_local_plans``), then ``metadata.json`` last.
ShardedObjects are bytes items under their ``unique_key`` holding ``torch.save([payload])``;
objects whose key Megatron-Core cannot parse as a ShardedObject's (``<key>/shard_<offset>_<shape>``,
e.g. a DCP source's bytes items or a legacy file's ``rng_state/mp_rank_00_000``) go into
``common.pt`` under their key instead (a note says so).

``dcp``: ``__0_{i}.distcp`` + ``.metadata`` only. Objects and the common state become bytes
items (``torch.save(value)``, as ``dcp.save`` stores non-tensors); the common state is flattened
the way ``dcp.save`` flattens a state dict (``optimizer.param_groups.0.lr``), its tensors become
tensor items, and ``planner_data`` maps each key to its nested path, so ``dcp.load`` and
``dcp_to_torch_save`` give the values back.

Options (``WriterOptions.extra``): ``files`` (number of data files; default
``max(2, total bytes / max_shard_size)``), ``threads`` (files written at once; default 1;
more than 1 calls ``source.read``/``objects`` from several threads, which they must allow),
``planner_data`` (``dcp`` only: ``{fqn: path tuple}`` for tensor/object keys, default
``(fqn,)``, i.e. a flat state dict). ``max_memory`` is met by the target chunk grid (the
planner cuts chunks to it); a DCP item is always one whole chunk.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from typing import Any, Callable

from ckpt_tool.formats.writer import WriteRequest, Writer

__all__ = ["TorchDistWriter", "DcpWriter"]

COMMON_FILE = "common.pt"
# What Megatron-Core's ShardedObject.empty_from_unique_key can parse back.
_SHARDED_OBJECT_KEY = re.compile(r"[^/]+/shard_\d+(\.\d+)*_\d+(\.\d+)*")


def _serialized(value: Any) -> io.BytesIO:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def _file_count(request: WriteRequest, writer: Writer, items: int) -> int:
    files = writer.options.extra.get("files")
    if files is None:
        total = request.meta.total_bytes
        files = max(2, math.ceil(total / max(1, writer.options.max_shard_size)))
    return max(1, min(int(files), max(1, items)))


def _run_dcp_save(writer: Writer, request: WriteRequest, items: list, planner_data,
                  keep_local_plans: bool,
                  tensor: Callable[[str, tuple, tuple], Any],
                  payload: Callable[[str], io.BytesIO]) -> None:
    """``dcp.save`` of ``items`` into ``writer.directory`` (original errors re-raised)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt_tool.formats._write_dcp_io import StreamingFileSystemWriter, StreamingSavePlanner

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
        share = split_by_bytes([(g, sum(_item_nbytes(i) for i in groups[g])) for g in groups],
                               ranks.world)[ranks.rank]
        items = [i for g in share for i in groups[g]]
    planner = StreamingSavePlanner(items, tensor, payload, planner_data=planner_data,
                                   keep_local_plans=keep_local_plans)
    storage = StreamingFileSystemWriter(
        str(writer.directory), files=_file_count(request, writer, len(items)),
        threads=int(writer.options.extra.get("threads", 1)),
        on_written=lambda item, nbytes: request.progress(nbytes),
        file_of=file_of if chunk_files else None)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=storage, planner=planner, no_dist=not distributed)
    except CheckpointException as exc:  # DCP wraps every failure (a BaseException)
        for original, _trace in exc.failures.values():
            raise original from None
        raise RuntimeError(str(exc)) from None


def _item_nbytes(item: Any) -> int:
    """Bytes of a tensor write item (bytes items count as small)."""
    td = getattr(item, "tensor_data", None)
    if td is None:
        return 1
    return max(1, math.prod(td.chunk.sizes) * td.properties.dtype.itemsize)


def _is_main(request: WriteRequest) -> bool:
    return request.ranks is None or request.ranks.is_main


def _tensor_items(request: WriteRequest) -> list:
    from ckpt_tool.formats._write_dcp_io import chunk_write_items

    items = []
    for t in request.meta.tensors.values():
        items += chunk_write_items(t)
    return items


def _stored_shape_note(request: WriteRequest) -> list[str]:
    keys = sorted(k for k, t in request.meta.tensors.items() if t.stored_shape is not None)
    if not keys:
        return []
    return [f"wrote {len(keys)} tensor{'s' * (len(keys) != 1)} in their logical shape, not the N-D reformulated "
            f"flattened layout of the source ({keys[0]}{', ...' if len(keys) > 1 else ''})"]


class TorchDistWriter(Writer):
    """Megatron-Core dist checkpoint, ``torch_dist`` backend (see the module docstring)."""

    format_name = "torch_dist"
    supports_ranks = True

    def write(self, request: WriteRequest) -> list[str]:
        """``common.pt``, the DCP items and ``.metadata``, then ``metadata.json``; keeps
        everything (tensors in their dtypes, ShardedObjects, the whole common state)."""
        import torch

        from ckpt_tool.dist_checkpointing.core import CheckpointingConfig, save_config
        from ckpt_tool.formats._write_dcp_io import bytes_write_item

        notes = _stored_shape_note(request)
        common = dict(request.common or {})
        object_keys, moved = [], []
        for key in dict.fromkeys(o.unique_key for o in request.meta.objects):
            if _SHARDED_OBJECT_KEY.fullmatch(key):
                object_keys.append(key)
            elif key not in common:  # a DCP source lists its bytes items in both
                common[key] = request.objects(key)
                moved.append(key)
        if moved:
            more = ", ..." if len(moved) > 3 else ""
            notes.append(f"stored {len(moved)} object{'s' * (len(moved) != 1)} that are not "
                         f"Megatron-Core ShardedObjects (key not '<key>/shard_<offset>_<shape>') in "
                         f"{COMMON_FILE}: {', '.join(moved[:3])}{more}")
        if _is_main(request):
            torch.save(common, self.directory / COMMON_FILE)
        items = _tensor_items(request) + [bytes_write_item(k) for k in object_keys]
        _run_dcp_save(self, request, items, planner_data=None, keep_local_plans=True,
                      tensor=request.source.read,
                      payload=lambda key: _serialized([request.objects(key)]))
        if request.ranks is not None:
            request.ranks.barrier()  # every rank's files and .metadata are in place
        if _is_main(request):  # the completeness marker, last
            save_config(CheckpointingConfig("torch_dist", 1), str(self.directory))
        return notes


class DcpWriter(Writer):
    """Plain PyTorch DCP checkpoint (see the module docstring)."""

    format_name = "dcp"
    supports_ranks = True

    def write(self, request: WriteRequest) -> list[str]:
        """The DCP items and ``.metadata``; objects and common values as bytes items."""
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.planner_helpers import _create_write_items

        from ckpt_tool.formats._write_dcp_io import bytes_write_item

        notes = _stored_shape_note(request)
        given = self.options.extra.get("planner_data") or {}
        items = _tensor_items(request)
        planner_data: dict[str, Any] = {k: tuple(given.get(k, (k,)))
                                        for k in request.meta.tensors}
        objects = []
        for o in request.meta.objects:
            if o.unique_key in planner_data:
                continue
            objects.append(o.unique_key)
            planner_data[o.unique_key] = tuple(given.get(o.unique_key, (o.unique_key,)))
            items.append(bytes_write_item(o.unique_key))

        object_set = set(objects)
        flat, mappings = flatten_state_dict(dict(request.common or {}))
        common: dict[str, Any] = {}
        clashes = []
        for fqn, value in flat.items():
            if fqn in object_set:
                continue  # a DCP source lists its bytes items as objects and as common state
            if fqn in planner_data:
                clashes.append(fqn)
                continue
            common[fqn] = value
            planner_data[fqn] = tuple(mappings.get(fqn, (fqn,)))
            items += _create_write_items(fqn, value)
        if clashes:
            notes.append(f"dropped {len(clashes)} common-state values whose key is also a "
                         f"tensor key ({', '.join(sorted(clashes)[:3])}"
                         f"{', ...' if len(clashes) > 3 else ''})")

        def tensor(fqn: str, offsets: tuple, sizes: tuple):
            value = common.get(fqn)
            if isinstance(value, torch.Tensor):
                return value
            return request.source.read(fqn, offsets, sizes)

        def payload(fqn: str) -> io.BytesIO:
            return _serialized(request.objects(fqn) if fqn in object_set else common[fqn])

        _run_dcp_save(self, request, items, planner_data=planner_data, keep_local_plans=False,
                      tensor=tensor, payload=payload)
        return notes
