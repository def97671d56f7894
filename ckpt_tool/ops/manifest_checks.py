"""Which integrity manifest covers a checkpoint ``validate`` reads, and ``validate
--write-manifest`` (the format: ``ckpt_tool.integrity_manifest``, docs/formats.md §11).

A checkpoint's manifest lies in its directory (``integrity.json`` or ``ckpt-manifest.json``),
beside a single file (``X.ckpt-manifest.json``), in a directory holding only ``model.pt``, or in
the training save directory that holds its ``iter_*`` directory (``ckpt convert --to legacy``
writes one manifest for the whole save directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tool.errors import FindingsError, InputError, plural
from ckpt_tool.integrity_manifest import (check_manifest, manifest_for, write_file_manifest,
                                          write_manifest)
from ckpt_tool.model import Finding
from ckpt_tool.storage import read_range

__all__ = ["manifest_findings", "check_source_manifest", "add_manifest", "ManifestResult"]


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


def check_source_manifest(given: Path, root: Path, ranks: Any = None) -> None:
    """The manifest covering a source that ``convert``, ``reshard`` or ``diff`` reads, checked
    before anything is written or compared: every listed file at its recorded size and, for
    files that are not ``torch.save`` archives, its digest (an archive's records are checked
    against their own CRC-32s as they are read, which covers every byte of its data: hashing
    it again would only double the cost). IntegrityError (exit 1) on the first mismatch.
    ``ranks``: under torchrun rank 0 checks and every rank gets its verdict."""
    from ckpt_tool.errors import IntegrityError

    job = ranks if ranks is not None and ranks.world > 1 else None
    problem = None
    if job is None or job.is_main:
        problem = _source_manifest_problem(given, root)
    if job is not None:
        problem = job.broadcast(problem)
    if problem is not None:
        file, message = problem
        raise IntegrityError(f"{file}: {message}" if file else message, path=root,
                             hint="the source changed after its manifest was written: "
                             "restore it from a good copy (if the change was intended, "
                             "remove the manifest or rewrite it with 'ckpt validate "
                             "--write-manifest')")


def _source_manifest_problem(given: Path, root: Path) -> tuple[str | None, str] | None:
    for owner, prefix in _where(given, root):
        found = manifest_for(owner)
        if found is None or (prefix and not _lists(found[0], prefix)):
            continue
        errors = [f for f in check_manifest(owner, deep=True, prefix=prefix,
                                            hash_only=_not_an_archive)
                  if f.severity == "error"]
        return (errors[0].file, errors[0].message) if errors else None
    return None


def _not_an_archive(path: Path) -> bool:
    """Whether ``path`` does not start like a zip archive (a torch.save file, a .distcp file
    of DCP items): its bytes are only checked by its manifest digest."""
    try:
        return read_range(path, 0, 4) != b"PK\x03\x04"
    except OSError:
        return True


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
