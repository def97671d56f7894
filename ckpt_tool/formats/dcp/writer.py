"""Streaming writer of plain PyTorch DCP checkpoints: ``__0_{i}.distcp`` + ``.metadata``.

The same streaming machinery as ``torch_dist`` (:mod:`ckpt_tool.formats.dcp_streaming`).
Objects and the common state become bytes items (``torch.save(value)``, as ``dcp.save`` stores
non-tensors); the common state is flattened the way ``dcp.save`` flattens a state dict
(``optimizer.param_groups.0.lr``), its tensors become tensor items, and ``planner_data`` maps
each key to its nested path, so ``dcp.load`` and ``dcp_to_torch_save`` give the values back.

Options (``WriterOptions.extra``): ``files``, ``threads`` as for ``torch_dist``;
``planner_data``: ``{fqn: path tuple}`` for tensor/object keys, default ``(fqn,)``.
"""

from __future__ import annotations

import io
from typing import Any

from ckpt_tool.formats.dcp_streaming import (
    bytes_write_item,
    run_dcp_save,
    serialized,
    stored_shape_note,
    tensor_items,
)
from ckpt_tool.formats.writer import WriteRequest, Writer

__all__ = ["DcpWriter"]


class DcpWriter(Writer):
    """Plain PyTorch DCP checkpoint (see the module docstring)."""

    format_name = "dcp"
    supports_ranks = True

    def write(self, request: WriteRequest) -> list[str]:
        """The DCP items and ``.metadata``; objects and common values as bytes items."""
        import torch
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.planner_helpers import _create_write_items


        notes = stored_shape_note(request)
        given = self.options.extra.get("planner_data") or {}
        items = tensor_items(request)
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
            return serialized(request.objects(fqn) if fqn in object_set else common[fqn])

        run_dcp_save(self, request, items, planner_data=planner_data, keep_local_plans=False,
                      tensor=tensor, payload=payload)
        return notes
