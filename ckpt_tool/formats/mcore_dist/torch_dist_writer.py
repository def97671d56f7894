"""Streaming writer of Megatron-Core ``torch_dist`` checkpoints.

When every chunk suits our ``torch.save`` archive writer (a dtype with a plain storage class,
under 4 GiB), the files and ``.metadata`` come from :mod:`ckpt_tool.formats.containers.dcp.dcp_torch_free_save`
(the same bytes and an equal ``Metadata`` as DCP's save, without its protocol): in one
process and on every rank of a torchrun job (each rank its ``__{rank}_{i}.distcp``, rank 0
the ``.metadata``), for ``convert`` and ``reshard`` alike. ``common.pt`` is the source's file
copied when the request passes one (``WriteRequest.common_file``: a torch_dist source
converted as is; nothing then imports torch when the objects' stored bytes items can be
copied too), else ``torch.save``'s bytes of the common state (``reshard``: its args change),
written without torch when it holds only plain values and dtypes
(:mod:`ckpt_tool.formats.containers.torch_zip.torch_save_object`).
Otherwise (another dtype, or ``extra["raw_save"]`` False):

``torch.distributed.checkpoint.save`` runs in this one process (no process group) with the
planner and file writer of :mod:`ckpt_tool.formats.containers.dcp.dcp_streaming`: every target chunk becomes
exactly one DCP item, pulled from ``request.source`` when the file writer reaches it and dropped
once written, so peak memory is about the largest chunk (times ``threads``).

What Megatron-Core 0.16.1 writes for one saving rank: ``common.pt`` (``torch.save`` of the
common state), ``__0_{i}.distcp`` data files, ``.metadata`` (``Metadata`` with
``planner_data=None`` and ``all_local_plans``), then ``metadata.json`` last. ShardedObjects are
bytes items under their ``unique_key`` holding ``torch.save([payload])``; objects whose key
Megatron-Core cannot parse as a ShardedObject's (``<key>/shard_<offset>_<shape>``, e.g. a DCP
source's bytes items or a legacy file's ``rng_state/mp_rank_00_000``) go into ``common.pt``
under their key instead (a note says so).

The common state keeps the source's form (:mod:`.forms`, from ``extra["source_extras"]``, the
source reader's metadata extras): a Megatron-Core 0.19 source's is written as 0.19 writes it,
the ``common_state`` object (bytes item ``common_state/shard_0_1``, ``torch.save([state])``)
with no ``common.pt`` and a ``metadata.json`` without ``common_backend*``; every other source's
as ``common.pt`` (the form every version reads). A ``common_state`` object among the target's
objects is never written as one: the common state given is the only one. A common state
written here (not a ``common.pt`` copied as it is) holds numpy scalars as Python scalars
(:mod:`.weights_only`: Megatron-Core loads it with ``torch.load(weights_only=True)``).

Options (``WriterOptions.extra``): ``raw_save`` (False: always DCP's save), ``files`` (number of data files; default
``max(2, total bytes / max_shard_size, threads)``), ``threads`` (files written at once; default 1;
more than 1 calls ``source.read``/``objects`` from several threads, which they must allow).
``max_memory`` is met by the target chunk grid (the planner cuts chunks to it).
"""

from __future__ import annotations

import os
import re
import shutil
from types import SimpleNamespace
from typing import Any

from ckpt_tool.formats.containers.dcp.dcp_torch_free_save import (
    is_main_rank,
    torch_free_write_applies,
    torch_free_write,
    stored_shape_note,
)
from ckpt_tool.formats.mcore_dist.config import CheckpointingConfig, save_config
from ckpt_tool.formats.mcore_dist.forms import (COMMON_FILE, COMMON_STATE_ITEM, COMMON_STATE_KEY,
                                                DistForm, form_of)
from ckpt_tool.formats.mcore_dist.weights_only import weights_only_common
from ckpt_tool.formats.containers.torch_zip.torch_save_object import object_item, save_object
from ckpt_tool.formats.writer import WriteRequest, Writer, WriterOptions
from ckpt_tool.model import CheckpointMeta

__all__ = ["TorchDistWriter"]

# What Megatron-Core's ShardedObject.empty_from_unique_key can parse back.
_SHARDED_OBJECT_KEY = re.compile(r"[^/]+/shard_\d+(\.\d+)*_\d+(\.\d+)*")


class TorchDistWriter(Writer):
    """Megatron-Core dist checkpoint, ``torch_dist`` backend (see the module docstring)."""

    format_name = "torch_dist"
    supports_ranks = True
    chunked = keeps_source_grid = True
    takes_raw_bytes = takes_stored_bytes = True
    megatron_resume_target = True

    @classmethod
    def writes_torch_free(cls, meta: CheckpointMeta, options: WriterOptions, *,
                          common_alone: bool = False) -> bool:
        """True when :meth:`write` takes the raw path for the target ``meta``
        (:func:`~ckpt_tool.formats.containers.dcp.dcp_torch_free_save.torch_free_write_applies`);
        with ``common_alone``, also that no object moves into ``common.pt`` (it is then the
        common state given, as given)."""
        if not torch_free_write_applies(meta, options):
            return False
        return not (common_alone and _object_keys(SimpleNamespace(meta=meta))[1])

    def write(self, request: WriteRequest) -> list[str]:
        """``common.pt``, the DCP items and ``.metadata``, then ``metadata.json``; keeps
        everything (tensors in their dtypes, ShardedObjects, the whole common state)."""
        notes = stored_shape_note(request)
        if self._write_raw(request, notes):
            return notes

        from ckpt_tool.formats.containers.dcp.dcp_streaming import (
            bytes_write_item,
            run_dcp_save,
            serialized,
            tensor_items,
        )

        form = self.form
        object_keys, others = _object_keys(request)
        common = _common_with_objects(request, others, notes, form)
        if form.common_object:
            object_keys.append(COMMON_STATE_ITEM)
        elif is_main_rank(request):  # torch.save's bytes (without torch where it can)
            save_object(common, self.directory / COMMON_FILE)
        items = tensor_items(request) + [bytes_write_item(k) for k in object_keys]
        run_dcp_save(self, request, items, planner_data=None, keep_local_plans=True,
                      tensor=request.source.read,
                      payload=lambda key: serialized(
                          [common if key == COMMON_STATE_ITEM else request.objects(key)]))
        if request.ranks is not None:
            request.ranks.barrier()  # every rank's files and .metadata are in place
        self._write_marker(request)
        return notes

    @property
    def form(self) -> DistForm:
        """The form to write: the source's (:func:`.forms.form_of` of its extras)."""
        return form_of(self.options.extra.get("source_extras"))

    def _write_marker(self, request: WriteRequest) -> None:
        """``metadata.json``, last, in the form's shape (rank 0)."""
        if is_main_rank(request):
            save_config(CheckpointingConfig("torch_dist", 1), str(self.directory),
                        common_backend=self.form.config_has_common_backend)

    def _write_raw(self, request: WriteRequest, notes: list[str]) -> bool:
        """The checkpoint through ``dcp_torch_free_save`` (our plan, archives and ``.metadata``; on
        every rank of a torchrun job) when every chunk suits the raw archive writer and
        ``extra["raw_save"]`` is not False; False (nothing written) otherwise.

        ``common.pt`` is the source's file copied as it is when the request passes one and
        no object moves into it (``convert`` of a torch_dist source), else ``torch.save``'s
        bytes of the common state as the DCP path writes them (``reshard``: its args change;
        without torch where ``torch_save_object`` can).
        Objects are their stored bytes items when the source has them, else
        ``torch.save([payload])`` as the DCP path writes them."""
        if not self.writes_torch_free(request.meta, self.options):
            return False
        form = self.form
        object_keys, others = _object_keys(request)
        if form.common_object:
            object_keys.append(COMMON_STATE_ITEM)

        def payload(key: str) -> bytes:
            if key == COMMON_STATE_ITEM:  # without torch when the common state allows
                common = _common_with_objects(request, others, notes, form)
                return object_item(common) or _serialized([common])
            stored = request.raw_object(key)
            if stored is not None:
                return stored
            return _serialized([request.objects(key)])

        def common_file() -> None:
            if not is_main_rank(request) or form.common_object:
                return
            if request.common_file is not None and not others:
                _copy_file(request.common_file, self.directory / COMMON_FILE)
            else:  # without torch when the common state allows (torch_save_object)
                save_object(_common_with_objects(request, others, notes, form),
                            self.directory / COMMON_FILE)

        # the integrity manifest's algorithm: sha256 (Megatron-Core's)
        torch_free_write(self, request, object_keys, payload, planner_data=None,
                  keep_local_plans=True, digest="sha256", prepare=common_file)
        if request.ranks is not None and request.ranks.world > 1:
            request.ranks.barrier()  # every rank's files are in place (.metadata: rank 0 said so)
        self._write_marker(request)
        return True




def _object_keys(request: Any) -> tuple[list[str], list[str]]:
    """The objects' keys of ``request`` (a ``WriteRequest``, or anything with the target
    ``meta``): ShardedObjects (stored as bytes items), then the others (which Megatron-Core
    cannot parse as a ShardedObject's: they go into the common state). A source's
    ``common_state`` object is neither: the common state is the request's."""
    keys = list(dict.fromkeys(o.unique_key for o in request.meta.objects
                              if o.key != COMMON_STATE_KEY))
    return ([k for k in keys if _SHARDED_OBJECT_KEY.fullmatch(k)],
            [k for k in keys if not _SHARDED_OBJECT_KEY.fullmatch(k)])


def _common_with_objects(request: WriteRequest, others: list[str], notes: list[str],
                         form: DistForm) -> dict:
    """The common state to save, with the ``others`` objects it does not hold yet (the first
    call notes them)."""
    common = dict(request.full_common() or {})
    moved = []
    for key in others:
        if key not in common:  # a DCP source lists its bytes items in both
            common[key] = request.objects(key)
            moved.append(key)
    if moved:
        more = ", ..." if len(moved) > 3 else ""
        note = (f"stored {len(moved)} object{'s' * (len(moved) != 1)} that are not "
                f"Megatron-Core ShardedObjects (key not '<key>/shard_<offset>_<shape>') in "
                f"{form.common_where}: {', '.join(moved[:3])}{more}")
        if note not in notes:
            notes.append(note)
    common, scalars = weights_only_common(common)  # (.weights_only)
    if scalars:
        more = ", ..." if len(scalars) > 3 else ""
        note = (f"{form.common_where}: numpy scalars stored as Python scalars of the same "
                f"value ({', '.join(scalars[:3])}{more}), as Megatron-Core's "
                "torch.load(weights_only=True) of it needs")
        if note not in notes:
            notes.append(note)
    return common


def _serialized(value: Any) -> bytes:
    from ckpt_tool.formats.containers.dcp.dcp_streaming import serialized

    return serialized(value).getvalue()


def _copy_file(src: os.PathLike, dst: os.PathLike) -> None:
    from ckpt_tool.storage import open_read

    with open_read(src) as fi, open(dst, "xb") as fo:
        shutil.copyfileobj(fi, fo, 16 << 20)
