"""``validate --deep``: PyTorch's own archive reader as the oracle.

The fast checks (``formats.containers.torch_zip.zip_directory``) apply every condition PyTorch's zip reader applies;
``--deep`` also asks that reader itself (``torch._C.PyTorchFileReader``, what ``torch.load``
and so Megatron-Core and DCP open archives with; nothing is unpickled) to open every
``torch.save`` archive the checkpoint stores -- DCP items of tensors and objects, legacy rank
files, torch.save files, ``common.pt``, zarr object files -- and read each record. An archive
it refuses is an error finding, whatever the fast checks said: whatever ``torch.load`` rejects,
``validate --deep`` reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_tool.formats.containers.torch_zip.archive_check import torch_reader_problem
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops.validate._checks import error
from ckpt_tool.model import Finding
from ckpt_tool.storage import open_read

__all__ = ["torch_reader_findings"]

_ITEM_LAYOUTS = ("torch_save", "flat")


def _archives(base: Path, meta: CheckpointMeta) -> list[tuple[str, int | None, int | None,
                                                            str | None, str]]:
    """``(file, offset, length, key, what)`` of every archive (offset None: a whole file)."""
    out: list[tuple[str, int | None, int | None, str | None, str]] = []
    whole = meta.kind.whole_file_archives  # (else archives are items inside data files)
    for key in sorted(meta.tensors):
        for c in meta.tensors[key].chunks:
            if not c.file or c.transforms:
                continue
            if whole:
                out.append((c.file, None, None, None, "file"))
            elif c.layout in _ITEM_LAYOUTS and c.byte_offset is not None and c.byte_length:
                out.append((c.file, c.byte_offset, c.byte_length, key,
                            f"chunk at {list(c.offsets)}"))
    for o in meta.objects:
        if not o.file:
            continue
        if meta.kind.dcp_files and o.byte_offset is not None and o.byte_length:
            out.append((o.file, o.byte_offset, o.byte_length, o.unique_key, "object"))
        elif whole or o.file.endswith(".pt"):
            out.append((o.file, None, None, None, "file"))
    if meta.kind.megatron_dist and (base / "common.pt").is_file():
        out.append(("common.pt", None, None, None, "file"))
    seen: set[tuple[str, int | None]] = set()
    unique = []
    for a in out:
        if (a[0], a[1]) not in seen:
            seen.add((a[0], a[1]))
            unique.append(a)
    return unique


def torch_reader_findings(base: Path, meta: CheckpointMeta, so_far: list[Finding],
                          stats: dict[str, int]) -> list[Finding]:
    """An error finding for every archive PyTorch's reader refuses (archives of keys or
    files already reported broken are skipped: their error is known)."""
    errors = [f for f in so_far if f.severity == "error"]
    broken_keys = {f.key for f in errors if f.key}
    broken_files = {f.file for f in errors if f.file and not f.key}
    out: list[Finding] = []
    checked = 0
    files: dict[str, Any] = {}
    try:
        for file, offset, length, key, what in _archives(base, meta):
            if file in broken_files or (key is not None and key in broken_keys):
                continue
            f = files.get(file)
            if f is None:
                try:
                    f = files[file] = open_read(base / file)
                except OSError:
                    continue  # reported by the storage checks
            size = f.seek(0, 2)
            start, n = (0, size) if offset is None else (offset, length or 0)
            if start + n > size or n <= 0:
                continue  # reported by the storage checks
            checked += 1
            problem = torch_reader_problem(f, start, n)
            if problem is not None:
                where = "" if offset is None else f"{what} at bytes [{start}, {start + n}): "
                out.append(error(f"{where}PyTorch's archive reader refuses it: {problem} "
                                 "(torch.load fails on it)", key=key, file=file))
    finally:
        for f in files.values():
            f.close()
    stats["archives_opened_by_torch"] = checked
    return out
