"""Which integrity manifest covers a checkpoint ``validate`` reads, and ``validate
--write-manifest`` (the format: ``ckpt_tool.manifest``, docs/formats.md §11).

A checkpoint's manifest lies in its directory (``integrity.json`` or ``ckpt-manifest.json``),
beside a single file (``X.ckpt-manifest.json``), in a directory holding only ``model.pt``, or in
the training save directory that holds its ``iter_*`` directory (``ckpt convert --to legacy``
writes one manifest for the whole save directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt_tool.errors import FindingsError, InputError, plural
from ckpt_tool.manifest import (check_manifest, manifest_for, write_file_manifest,
                                write_manifest)
from ckpt_tool.model import Finding

__all__ = ["manifest_findings", "add_manifest", "ManifestResult"]


def _where(given: Path, root: Path) -> list[tuple[Path, str]]:
    """``(manifest owner, prefix)`` pairs that cover the checkpoint at ``root`` (as given
    by the user: ``given``); the first that exists is used."""
    out: list[tuple[Path, str]] = []
    if root.is_dir():
        out.append((root, ""))
    else:
        out.append((root, ""))  # X.ckpt-manifest.json beside the file
        if given.is_dir() and given != root:
            out.append((given, ""))  # a directory holding only model.pt
    if given.is_dir() and given.resolve() != root.resolve() and (given, "") not in out:
        out.append((given, ""))  # a training save directory given: its manifest covers all
    parent = root.parent
    if root.is_dir() and parent != root:  # an iter_* directory: its save directory's manifest
        out.append((parent, root.name + "/"))
    return out


def manifest_findings(given: Path, root: Path, *, deep: bool,
                      stats: dict[str, int]) -> list[Finding]:
    """Findings of the manifest covering the checkpoint at ``root`` (none without one)."""
    for owner, prefix in _where(given, root):
        found = manifest_for(owner)
        if found is None:
            continue
        if prefix and not _lists(found[0], prefix):
            continue
        return check_manifest(owner, deep=deep, prefix=prefix, stats=stats)
    return []


def _lists(manifest: Path, prefix: str) -> bool:
    import json

    try:
        files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
        return isinstance(files, dict) and any(str(n).startswith(prefix) for n in files)
    except (OSError, ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class ManifestResult:
    """What ``validate --write-manifest`` wrote."""

    manifest: str
    files: int


def add_manifest(given: Path, root: Path, findings: list[Finding]) -> ManifestResult:
    """Write a manifest for the checkpoint at ``root`` that ``validate`` found valid (with
    ``findings``): into its directory (or beside the single file). An existing manifest is
    checked with its digests first: one that no longer matches is never replaced (that would
    vouch for damaged data). The only write ``ckpt`` makes into an input: one file, renamed
    into place."""
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        first = errors[0]
        raise FindingsError(
            f"not writing a manifest: the checkpoint does not validate "
            f"({plural(len(errors), 'error')}; first: {first.file or first.key or ''}: "
            f"{first.message})", path=root, hint="repair or rewrite the checkpoint first")
    owner = root if root.is_dir() else (given if given.is_dir() else root)
    if manifest_for(owner) is not None:
        stale = [f for f in check_manifest(owner, deep=True) if f.severity == "error"]
        if stale:
            raise FindingsError(
                f"not replacing the manifest: {stale[0].file or ''}: {stale[0].message}",
                path=owner, hint="the data changed after the manifest was written; remove "
                "the manifest only if that change was intended")
    try:
        if owner.is_dir():
            path = write_manifest(owner)
        else:
            path = write_file_manifest(owner)
    except OSError as exc:
        raise InputError(f"cannot write the manifest ({exc.strerror})", path=owner,
                         hint="check the directory's permissions and free space") from None
    import json

    files = len(json.loads(path.read_text(encoding="utf-8"))["files"])
    return ManifestResult(str(path), files)
