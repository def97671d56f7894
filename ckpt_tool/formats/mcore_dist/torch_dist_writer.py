"""Streaming writer of Megatron-Core ``torch_dist`` checkpoints.

``torch.distributed.checkpoint.save`` runs in this one process (no process group) with the
planner and file writer of :mod:`ckpt_tool.formats.dcp_streaming`: every target chunk becomes
exactly one DCP item, pulled from ``request.source`` when the file writer reaches it and dropped
once written, so peak memory is about the largest chunk (times ``threads``).

What Megatron-Core 0.16.1 writes for one saving rank: ``common.pt`` (``torch.save`` of the
common state), ``__0_{i}.distcp`` data files, ``.metadata`` (``Metadata`` with
``planner_data=None`` and ``all_local_plans``), then ``metadata.json`` last. ShardedObjects are
bytes items under their ``unique_key`` holding ``torch.save([payload])``; objects whose key
Megatron-Core cannot parse as a ShardedObject's (``<key>/shard_<offset>_<shape>``, e.g. a DCP
source's bytes items or a legacy file's ``rng_state/mp_rank_00_000``) go into ``common.pt``
under their key instead (a note says so).

Options (``WriterOptions.extra``): ``files`` (number of data files; default
``max(2, total bytes / max_shard_size, threads)``), ``threads`` (files written at once; default 1;
more than 1 calls ``source.read``/``objects`` from several threads, which they must allow).
``max_memory`` is met by the target chunk grid (the planner cuts chunks to it).
"""

from __future__ import annotations

import re

from ckpt_tool.formats.dcp_streaming import (
    bytes_write_item,
    is_main_rank,
    run_dcp_save,
    serialized,
    stored_shape_note,
    tensor_items,
)
from ckpt_tool.formats.mcore_dist.config import CheckpointingConfig, save_config
from ckpt_tool.formats.write_guard import torch_save_file
from ckpt_tool.formats.writer import WriteRequest, Writer

__all__ = ["TorchDistWriter"]

COMMON_FILE = "common.pt"
# What Megatron-Core's ShardedObject.empty_from_unique_key can parse back.
_SHARDED_OBJECT_KEY = re.compile(r"[^/]+/shard_\d+(\.\d+)*_\d+(\.\d+)*")


class TorchDistWriter(Writer):
    """Megatron-Core dist checkpoint, ``torch_dist`` backend (see the module docstring)."""

    format_name = "torch_dist"
    supports_ranks = True

    def write(self, request: WriteRequest) -> list[str]:
        """``common.pt``, the DCP items and ``.metadata``, then ``metadata.json``; keeps
        everything (tensors in their dtypes, ShardedObjects, the whole common state)."""
        notes = stored_shape_note(request)
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
        if is_main_rank(request):
            torch_save_file(common, self.directory / COMMON_FILE)
        items = tensor_items(request) + [bytes_write_item(k) for k in object_keys]
        run_dcp_save(self, request, items, planner_data=None, keep_local_plans=True,
                      tensor=request.source.read,
                      payload=lambda key: serialized([request.objects(key)]))
        if request.ranks is not None:
            request.ranks.barrier()  # every rank's files and .metadata are in place
        if is_main_rank(request):  # the completeness marker, last
            save_config(CheckpointingConfig("torch_dist", 1), str(self.directory))
        return notes
