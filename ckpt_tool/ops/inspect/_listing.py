"""The checkpoints a directory holds (``ckpt inspect DIR`` on a folder of checkpoints): each
one found at most a few levels down, with what its metadata says cheaply (format, iterations,
layout, size, whether it carries an integrity manifest). Metadata only: no tensor data read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["checkpoints_under", "DEPTH"]

DEPTH = 3  # levels below the directory searched (a runs folder, its save dirs, their iter_*)
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def checkpoints_under(root: str | Path, depth: int = DEPTH) -> list[dict[str, Any]]:
    """One entry per checkpoint in ``root`` or below (``depth`` levels at most), sorted by
    path: ``path`` (relative to ``root``), ``format``, ``iterations`` (a training save
    directory's, else None), ``layout`` (``{"tp": 2, "pp": 2, ...}`` or None), ``bytes`` and
    ``manifest`` (True when an integrity manifest is there: ``validate --write-manifest``
    found it valid). A checkpoint's own directories are not searched further."""
    from ckpt_tool.formats.save_dir import iteration_dirs

    root = Path(root)
    found: list[dict[str, Any]] = []
    level = [root]
    for _ in range(depth):
        below = []
        for d in level:
            try:
                children = sorted(x for x in d.iterdir() if not x.name.startswith("."))
            except OSError:
                continue
            for x in children:
                if x.is_dir() and not x.is_symlink():
                    iters = iteration_dirs(x)
                    entry = _entry(root, x, iters[-1] if iters else x)
                    if entry is None:
                        below.append(x)
                        continue
                    if iters:
                        entry["iterations"] = [i.name for i in iters]
                    found.append(entry)
                elif x.is_file() and x.suffix.lower() in _FILE_SUFFIXES \
                        and (entry := _entry(root, x, x)) is not None:
                    found.append(entry)
        level = below
    return sorted(found, key=lambda e: e["path"])


def _entry(root: Path, where: Path, checkpoint: Path) -> dict[str, Any] | None:
    """What ``checkpoint`` (``where`` itself or its latest iteration) is; None if it is
    none of the known formats."""
    from ckpt_tool.errors import CkptError
    from ckpt_tool.formats.base import open_checkpoint
    from ckpt_tool.integrity_manifest import manifest_name

    try:
        with open_checkpoint(checkpoint) as reader:
            meta = reader.metadata()
    except CkptError:
        return None
    parallel = meta.common.get("parallel") if isinstance(meta.common, dict) else None
    layout = {k: parallel[k] for k in ("tp", "pp", "ep") if k in parallel} \
        if isinstance(parallel, dict) else None
    base = Path(meta.root) if Path(meta.root).is_dir() else checkpoint
    return {"path": str(where.relative_to(root)) + ("/" if where.is_dir() else ""),
            "format": meta.format, "iterations": None, "layout": layout or None,
            "bytes": _size(where),
            "manifest": base.is_dir() and (base / manifest_name(base)).is_file()}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
