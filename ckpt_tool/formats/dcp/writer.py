"""Streaming writer of plain PyTorch DCP checkpoints: ``__0_{i}.distcp`` + ``.metadata``.

The same streaming machinery as ``torch_dist`` (:mod:`ckpt_tool.formats.dcp_streaming`).
Objects and the common state become bytes items (``torch.save(value)``, as ``dcp.save`` stores
non-tensors); the common state is flattened the way ``dcp.save`` flattens a state dict
(``optimizer.param_groups.0.lr``), each value a bytes item (its tensors too, so that a reader
tells the model's tensors from the common state's), and ``planner_data`` maps each key to its
nested path, so ``dcp.load`` and ``dcp_to_torch_save`` give the values back.

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
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        notes = stored_shape_note(request)
        given = self.options.extra.get("planner_data") or {}
        items = tensor_items(request)
        planner_data: dict[str, Any] = {k: tuple(given.get(k, (k,)))
                                        for k in request.meta.tensors}
        # the common state first: its bytes items keep their nested paths (a DCP source lists
        # the same items as objects too: ``Reader.objects_in_common``)
        flat, mappings = flatten_state_dict(dict(request.common or {}))
        common: dict[str, Any] = {}
        clashes = []
        for fqn, value in flat.items():
            if fqn in planner_data:
                clashes.append(fqn)
                continue
            common[fqn] = value
            planner_data[fqn] = tuple(mappings.get(fqn, (fqn,)))
            items.append(bytes_write_item(fqn))  # tensors too: a reader tells them apart
        if clashes:
            notes.append(f"dropped {len(clashes)} common-state values whose key is also a "
                         f"tensor key ({', '.join(sorted(clashes)[:3])}"
                         f"{', ...' if len(clashes) > 3 else ''})")
        objects = []
        for o in request.meta.objects:
            if o.unique_key in planner_data:
                continue
            objects.append(o.unique_key)
            planner_data[o.unique_key] = tuple(given.get(o.unique_key, (o.unique_key,)))
            items.append(bytes_write_item(o.unique_key))
        object_set = set(objects)

        def tensor(fqn: str, offsets: tuple, sizes: tuple):
            return request.source.read(fqn, offsets, sizes)

        def payload(fqn: str) -> io.BytesIO:
            return serialized(request.objects(fqn) if fqn in object_set else common[fqn])

        run_dcp_save(self, request, items, planner_data=planner_data, keep_local_plans=False,
                      tensor=tensor, payload=payload)
        return notes
