"""Plain PyTorch DCP checkpoints (``torch.distributed.checkpoint``).

On disk (docs/formats.md §3): ``.metadata`` (a pickled ``Metadata``: every tensor's chunks
and their storage items) and ``__{rank}_{i}.distcp`` files, each item an independent
``torch.save`` archive at a byte range of its file. Shared with ``torch_dist``:
:mod:`ckpt_tool.formats.containers.dcp.dcp_metadata`, :mod:`~ckpt_tool.formats.containers.dcp.dcp_items`,
:mod:`~ckpt_tool.formats.containers.dcp.dcp_streaming`.

Modules: :mod:`.reader`, :mod:`.writer`. The real library's code: torch
``distributed/checkpoint/{filesystem,metadata,default_planner}.py``.
"""
