"""What ``convert``, ``reshard`` and ``diff`` check of a source before they read its data.

The checks of ``validate`` that need no tensor bytes: the checkpoint holds tensors, and every
tensor to be read is covered by its chunks exactly once (in bounds, no gap, no overlap) with a
dtype ``ckpt`` knows. A source failing them is damaged: reading it would fill the gaps with
whatever the output buffer held, or write an empty checkpoint that itself validates. The
bytes themselves are checked as they are read (``formats.containers.torch_zip.archive_check``; the item is the
ground truth for its dtype and size, ``dcp_items.assemble``, ``_torch_free_source``).
"""

from __future__ import annotations

from typing import Iterable

from ckpt_tool.errors import IntegrityError
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops.validate._checks import check_coverage
from ckpt_tool.ops.validate._items import check_overlaps
from ckpt_tool.ops.validate._meta import check_common_state, check_meta_against_files
from ckpt_tool.storage import as_path

__all__ = ["check_source", "UNVERIFIED_NOTE"]

_HINT = "the source is damaged: 'ckpt validate' lists what is wrong"
#: What an output says when the source's bytes were not checked (``--no-verify``).
UNVERIFIED_NOTE = ("--no-verify: the source's bytes were not checked against their CRC-32s "
                   "(damage in it is copied as it is)")


def check_source(meta: CheckpointMeta, keys: Iterable[str] | None = None, *,
                 needs_common: bool = False) -> None:
    """IntegrityError (exit 1) naming the first problem of the source's metadata: what the
    files contradict (no tensors at all, another backend's files, a relabelled zarr dtype:
    ``_meta``), items that share bytes, a missing common state when the output
    carries it on (``needs_common``: it would be written empty, and look complete), or a
    tensor of ``keys`` (default: all) that its chunks do not cover exactly once or whose
    dtype is unknown."""
    root = as_path(meta.root)
    base = root if root.is_dir() else root.parent
    problems = check_meta_against_files(base, meta) + check_overlaps(meta) + (
        check_common_state(base, meta) if needs_common else [])
    problems = [f for f in problems if f.severity == "error"]  # (an empty save: a warning)
    if problems:
        first = problems[0]
        where = f"{first.key}: " if first.key else ""
        where = f"{first.file}: {where}" if first.file and first.file not in first.message \
            else where
        raise IntegrityError(f"{where}{first.message}", path=meta.root, hint=_HINT)
    for key in sorted(meta.tensors if keys is None else set(keys)):
        t = meta.tensors.get(key)
        if t is None:
            continue
        problems = [f for f in check_coverage(t) if f.severity == "error"]
        if problems:
            first = problems[0]
            where = f" ({first.file})" if first.file else ""
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise IntegrityError(f"tensor {key}: {first.message}{where}{more}",
                                 path=meta.root, hint=_HINT)
