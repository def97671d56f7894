"""The integrity manifest of a checkpoint the library saves: Megatron-Core's ``integrity.json``
(``ckpt_tool.integrity_manifest``, docs/formats.md §11), written by rank 0 just before ``metadata.json``.

Each rank's writer computed the sha256 of the data files it wrote right after their fsync
(``filesystem_async.take_file_digests``, in the checkpoint process for async saves); the
digests are gathered here, rank 0 hashes what is left (``common.pt``, ``.metadata``, the
files of strategies that report no digests) and the digest of the ``metadata.json`` about to
be written, and writes the manifest atomically. A save killed before that leaves no
``metadata.json``: the manifest never vouches for an incomplete checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Tuple

import torch

from ckpt_tool.integrity_manifest import INTEGRITY_JSON, is_manifest, write_manifest

from .strategies.filesystem_async import take_file_digests

__all__ = ["write_integrity_json", "remove_integrity_json"]

_MARKER = "metadata.json"


def remove_integrity_json(checkpoint_dir: str) -> None:
    """Drop the manifest of an earlier save into the same directory (rank 0, before a save):
    it must not vouch for the new files."""
    try:
        os.remove(os.path.join(checkpoint_dir, INTEGRITY_JSON))
    except FileNotFoundError:
        pass


def write_integrity_json(checkpoint_dir: str, marker: bytes) -> None:
    """Call on every rank after all ranks wrote their files (a collective under torchrun);
    ``marker``: the bytes of the ``metadata.json`` rank 0 writes next."""
    local = take_file_digests(checkpoint_dir)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        rank = dist.get_rank()
    else:
        parts, rank = [local], 0
    if rank != 0:
        return
    known: Dict[str, Tuple[int, str]] = {}
    for part in parts:
        known.update(part or {})
    names = []
    for dirpath, dirs, files in os.walk(checkpoint_dir):
        dirs.sort()
        rel = os.path.relpath(dirpath, checkpoint_dir)
        for f in files:
            name = f if rel == "." else f"{rel}/{f}".replace(os.sep, "/")
            if rel == "." and (is_manifest(f) or f == _MARKER or f.startswith(_MARKER + ".")):
                continue
            names.append(name)
    # (ranks that saved into directories of their own, e.g. the local spools of a save to an
    # object store, name files rank 0 does not see)
    names = sorted(set(names) | {n for n in known if "/" in n or not (
        is_manifest(n) or n == _MARKER or n.startswith(_MARKER + "."))})
    known = {n: v for n, v in known.items() if n in set(names)}
    known[_MARKER] = (len(marker), hashlib.sha256(marker).hexdigest())
    write_manifest(checkpoint_dir, algorithm="sha256", known=known, names=names,
                   name=INTEGRITY_JSON)
