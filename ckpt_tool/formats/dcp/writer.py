"""Streaming writer of plain PyTorch DCP checkpoints: ``__{rank}_{i}.distcp`` + ``.metadata``.

Objects and the common state become bytes items (``torch.save(value)``, as ``dcp.save`` stores
non-tensors); the common state is flattened the way ``dcp.save`` flattens a state dict
(``optimizer.param_groups.0.lr``: :func:`ckpt_tool.formats.containers.dcp.dcp_bytes_items.flatten_state`),
each value a bytes item (its tensors too, so that a reader tells the model's tensors from the
common state's), and ``planner_data`` maps each key to its nested path, so ``dcp.load`` and
``dcp_to_torch_save`` give the values back.

As for ``torch_dist`` (:mod:`ckpt_tool.formats.mcore_dist.torch_dist_writer`): when every
chunk suits our ``torch.save`` archive writer, :mod:`ckpt_tool.formats.containers.dcp.dcp_torch_free_save` writes the
files and ``.metadata`` (the same bytes and an equal ``Metadata`` as DCP's save), in one
process and on every rank of a torchrun job. The bytes items are then written without torch
where the source was read without it: a torch_dist source passes its ``common.pt`` and its
objects' stored bytes (``WriteRequest.common_file``/``raw_object``): the common state is
loaded with torch dtypes as stand-ins and each value pickled as ``torch.save`` would
(:mod:`ckpt_tool.formats.containers.torch_zip.torch_save_object`, values of an allowlist of types), each object
loses its list at the byte level (:mod:`ckpt_tool.formats.containers.dcp.dcp_bytes_items`); any other value
is ``torch.save``d. Otherwise (another dtype, or ``extra["raw_save"]`` False)
``torch.distributed.checkpoint.save`` runs with the planner and file writer of
:mod:`ckpt_tool.formats.containers.dcp.dcp_streaming`.

Options (``WriterOptions.extra``): ``raw_save`` (False: always DCP's save), ``files``,
``threads`` as for ``torch_dist``; ``planner_data``: ``{fqn: path tuple}`` for tensor/object
keys, default ``(fqn,)``.
"""

from __future__ import annotations

import io
import threading
from typing import Any, Callable

from ckpt_tool.formats.containers.dcp.dcp_torch_free_save import (torch_free_write_applies,
                                                                  torch_free_write,
                                                                  stored_shape_note)
from ckpt_tool.formats.containers.dcp.dcp_bytes_items import flatten_state
from ckpt_tool.formats.writer import WriteRequest, Writer

__all__ = ["DcpWriter"]


class DcpWriter(Writer):
    """Plain PyTorch DCP checkpoint (see the module docstring)."""

    format_name = "dcp"
    supports_ranks = True
    chunked = keeps_source_grid = True
    takes_raw_bytes = takes_stored_bytes = True

    def write(self, request: WriteRequest) -> list[str]:
        """The DCP items and ``.metadata``; objects and common values as bytes items."""
        notes = stored_shape_note(request)
        raw = torch_free_write_applies(request.meta, self.options)
        torch_free = _torch_free_common(request) if raw else None
        common = torch_free if torch_free is not None else dict(request.full_common() or {})
        planner_data, flat, objects = self._plan(request, common, notes)
        if raw:
            payload = _Payloads(request, flat, objects, torch_free is not None)
            torch_free_write(self, request, list(flat) + objects, payload.archive,
                      planner_data=planner_data, keep_local_plans=False, digest="crc32")
            return notes

        from ckpt_tool.formats.containers.dcp.dcp_streaming import (
            bytes_write_item,
            run_dcp_save,
            serialized,
            tensor_items,
        )

        items = tensor_items(request) + [bytes_write_item(k) for k in list(flat) + objects]
        object_set = set(objects)

        def payload(fqn: str) -> io.BytesIO:
            return serialized(request.objects(fqn) if fqn in object_set else flat[fqn])

        run_dcp_save(self, request, items, planner_data=planner_data, keep_local_plans=False,
                     tensor=lambda fqn, offsets, sizes: request.source.read(fqn, offsets, sizes),
                     payload=payload)
        return notes

    def _plan(self, request: WriteRequest, common: dict, notes: list[str]
              ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
        """``planner_data`` (every key's nested path), the flattened common values to store
        and the objects' keys, in the order their bytes items are written."""
        given = self.options.extra.get("planner_data") or {}
        planner_data: dict[str, Any] = {k: tuple(given.get(k, (k,)))
                                        for k in request.meta.tensors}
        # the common state first: its bytes items keep their nested paths (a DCP source lists
        # the same items as objects too: ``Reader.objects_in_common``)
        flat, mappings = flatten_state(common)
        clashes = sorted(k for k in flat if k in planner_data)
        flat = {k: v for k, v in flat.items() if k not in planner_data}
        for fqn in flat:
            planner_data[fqn] = tuple(mappings.get(fqn, (fqn,)))
        if clashes:
            notes.append(f"dropped {len(clashes)} common-state values whose key is also a "
                         f"tensor key ({', '.join(clashes[:3])}"
                         f"{', ...' if len(clashes) > 3 else ''})")
        objects = []
        for o in request.meta.objects:
            if o.unique_key in planner_data:
                continue
            objects.append(o.unique_key)
            planner_data[o.unique_key] = tuple(given.get(o.unique_key, (o.unique_key,)))
        return planner_data, flat, objects


def _torch_free_common(request: WriteRequest) -> dict | None:
    """The common state loaded without torch (torch dtypes as stand-ins) from the source's
    ``common.pt`` when the request passes one and that needs no torch, else None."""
    if request.common_file is None:
        return None
    from ckpt_tool.formats.containers.torch_zip.torch_save_object import load_exact

    # None also for a global the allowlist refuses: the reader decides, with its --trust,
    # through ``full_common``
    common = load_exact(request.common_file)
    return common if isinstance(common, dict) else None


class _Payloads:
    """Each bytes item's ``torch.save`` archive for the raw path: without torch for common
    values loaded without it (``torch_free``) and for objects the source stores as
    ``torch.save([payload])`` (tensors included: the list taken off the stored archive);
    through ``torch.save`` of the value loaded with torch otherwise (thread-safe)."""

    def __init__(self, request: WriteRequest, flat: dict[str, Any], objects: list[str],
                 torch_free: bool):
        self._request, self._flat, self._torch_free = request, flat, torch_free
        self._objects = set(objects)
        self._lock = threading.Lock()
        self._torch_flat: dict[str, Any] | None = None

    def archive(self, fqn: str) -> bytes:
        from ckpt_tool.formats.containers.dcp.dcp_bytes_items import unwrapped_archive
        from ckpt_tool.formats.containers.torch_zip.torch_save_object import object_archive_of

        data = None
        if fqn in self._objects:
            stored = self._request.raw_object(fqn)  # torch.save([payload]) as stored
            data = None if stored is None else unwrapped_archive(stored)
            if data is None:
                return self._torch_save(lambda: self._request.objects(fqn))
        elif self._torch_free:
            data = object_archive_of(self._flat[fqn])
        if data is not None:
            return data
        return self._torch_save(lambda: self._torch_common()[fqn])

    def _torch_common(self) -> dict[str, Any]:
        if not self._torch_free:
            return self._flat
        with self._lock:  # the common state loaded with torch, once
            if self._torch_flat is None:
                self._torch_flat = flatten_state(dict(self._request.full_common() or {}))[0]
            return self._torch_flat

    @staticmethod
    def _torch_save(value: Callable[[], Any]) -> bytes:
        from ckpt_tool.formats.containers.dcp.dcp_streaming import serialized

        return serialized(value()).getvalue()
