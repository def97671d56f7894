"""Integrity manifests: the digest and size of every file of a checkpoint (docs/formats.md §11).

safetensors, torch.save files, DCP and Megatron-LM legacy checkpoints carry no checksum of
their data (the CRC32 of torch.save zip entries is not checked by ``torch.load``, and
safetensors has none). Every output ``ckpt`` writes carries a manifest, and ``validate``
checks it:

* Megatron-Core dist checkpoints (a ``metadata.json`` beside it) get Megatron-Core's own
  ``integrity.json``: ``{"algorithm": "sha256", "files": {name: hexdigest}}``, plus
  ``"sizes": {name: bytes}`` (a field readers of that file ignore);
* every other directory gets the sidecar ``ckpt-manifest.json`` (same fields, ``"algorithm":
  "crc32"``: ISA-L's CRC-32 runs at memory speed, and it catches every error burst up to 32
  bits); a single-file output ``X`` gets ``X.ckpt-manifest.json`` beside it.

Names are paths relative to the manifest's directory, ``/``-separated; every regular file under
it is listed except the manifest itself. Hashing streams the files in blocks (bounded memory),
several files at once on threads (hashlib and the CRC release the GIL). Nothing here imports
torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from ckpt_tool._crc import crc32
from ckpt_tool.digests import noted
from ckpt_tool.model import Finding
from ckpt_tool.storage import as_path, file_size, is_remote, open_read

__all__ = ["INTEGRITY_JSON", "SIDECAR", "FILE_SUFFIX", "ALGORITHMS", "digest_file",
           "manifest_name", "build_manifest", "write_manifest", "write_file_manifest",
           "manifest_for", "check_manifest", "is_manifest"]

INTEGRITY_JSON = "integrity.json"  # Megatron-Core's opt-in file (dist checkpoints)
SIDECAR = "ckpt-manifest.json"  # ours, for directories of every other format
FILE_SUFFIX = ".ckpt-manifest.json"  # beside a single-file output: X.safetensors + this
ALGORITHMS = ("sha256", "crc32")
_BLOCK = 8 << 20
_THREADS = 4


def is_manifest(name: str) -> bool:
    """True for the names of manifest files (which other code must not take for data)."""
    return name in (INTEGRITY_JSON, SIDECAR) or name.endswith(FILE_SUFFIX)


def digest_file(path: str | Path, algorithm: str) -> tuple[int, str]:
    """``(size, hex digest)`` of one file, read in blocks of 8 MiB."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r}")
    h = hashlib.sha256() if algorithm == "sha256" else None
    crc = size = 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with (open_read(path) if is_remote(path) else open(path, "rb", buffering=0)) as f:
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])
            else:
                crc = crc32(view[:n], crc)
            size += n
    return size, h.hexdigest() if h is not None else f"{crc & 0xFFFFFFFF:08x}"


def manifest_name(root: str | Path) -> str:
    """``integrity.json`` in a Megatron-Core dist checkpoint, else the sidecar's name."""
    return INTEGRITY_JSON if (Path(root) / "metadata.json").is_file() else SIDECAR


def _files(root: Path) -> list[str]:
    if is_remote(root):
        head = len(root.key) + 1 if root.key else 0
        names = sorted(key[head:] for key, _ in root.store.walk(root.key))
        return [n for n in names if not ("/" not in n and is_manifest(n))]
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        rel = Path(dirpath).relative_to(root)
        for name in sorted(files):
            path = rel / name
            if path.parent == Path(".") and is_manifest(name):
                continue
            if os.path.isfile(os.path.join(dirpath, name)):
                out.append(path.as_posix())
    return out


def _digest_all(root: Path, names: list[str], algorithm: str) -> list[tuple[int, str]]:
    if len(names) <= 1:
        return [digest_file(root / n, algorithm) for n in names]
    with ThreadPoolExecutor(min(_THREADS, len(names)), thread_name_prefix="ckpt-hash") as pool:
        return list(pool.map(lambda n: digest_file(root / n, algorithm), names))


def build_manifest(root: str | Path, *, algorithm: str | None = None,
                   names: Iterable[str] | None = None,
                   known: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """The manifest document of the files under ``root`` (all of them, or ``names``);
    ``known``: ``{name: (size, digest)}`` already computed (not read again)."""
    root = Path(root)
    algorithm = algorithm or ("sha256" if manifest_name(root) == INTEGRITY_JSON else "crc32")
    names = sorted(set(_files(root) if names is None else names) | set(known or ()))
    found = dict(known or {})
    for n in names:  # digests computed while the files were written
        if n not in found and (hit := noted(root / n, algorithm)) is not None:
            found[n] = hit
    todo = [n for n in names if n not in found]
    found.update(zip(todo, _digest_all(root, todo, algorithm)))
    return {"algorithm": algorithm,
            "files": {n: found[n][1] for n in names},
            "sizes": {n: found[n][0] for n in names}}


def _write_atomically(path: Path, doc: dict[str, Any]) -> None:
    """``path`` appears whole or not at all: a temporary file beside it, fsynced, renamed."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries durable); some file systems refuse: ignored."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask (read without changing it for long)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_manifest(root: str | Path, *, algorithm: str | None = None,
                   known: dict[str, tuple[int, str]] | None = None,
                   names: Iterable[str] | None = None, name: str | None = None) -> Path:
    """Write the manifest of the directory ``root`` into it (atomically) and return its path:
    ``integrity.json`` for a Megatron-Core dist checkpoint, else ``ckpt-manifest.json`` (or
    ``name``)."""
    root = Path(root)
    path = root / (name or manifest_name(root))
    _write_atomically(path, build_manifest(root, algorithm=algorithm, known=known, names=names))
    return path


def write_file_manifest(file: str | Path, *, as_name: str | None = None,
                        into: str | Path | None = None) -> Path:
    """Write the manifest of the single file ``file`` beside it (``X`` + ``FILE_SUFFIX``), or
    into the directory ``into``; ``as_name``: the name the file will have (its final name
    when it is still in a staging directory)."""
    file = Path(file)
    name = as_name or file.name
    size, digest = digest_file(file, "crc32")
    doc = {"algorithm": "crc32", "files": {name: digest}, "sizes": {name: size}}
    path = Path(into or file.parent) / (name + FILE_SUFFIX)
    _write_atomically(path, doc)
    return path


def manifest_for(path: str | Path) -> tuple[Path, Path] | None:
    """``(manifest file, the directory its names are relative to)`` for a checkpoint
    directory or file, or None when it has none."""
    p = as_path(path)
    if p.is_dir():
        for name in (INTEGRITY_JSON, SIDECAR):
            if (p / name).is_file():
                return p / name, p
        return None
    side = p.parent / (p.name + FILE_SUFFIX)
    return (side, p.parent) if side.is_file() else None


def _finding(severity: str, message: str, file: str | None) -> Finding:
    return Finding(severity, None, file, message)


def _read(path: Path) -> tuple[str, dict[str, str], dict[str, int] | None]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    files = doc["files"]
    sizes = doc.get("sizes")
    if not isinstance(files, dict) or not (sizes is None or isinstance(sizes, dict)):
        raise TypeError("'files' or 'sizes' is not an object")
    return str(doc.get("algorithm", "sha256")), files, sizes


def check_manifest(path: str | Path, *, deep: bool = False, prefix: str = "",
                   stats: dict[str, int] | None = None,
                   hash_only: Callable[[Path], bool] | None = None) -> list[Finding]:
    """Findings of the manifest of the checkpoint at ``path`` (none when it has none).

    Always: the manifest parses, every file it lists exists with the recorded size, and no
    file under its directory is unlisted (a warning). The digests are compared with ``deep``,
    or always when the manifest records no sizes (Megatron-Core's own ``integrity.json``):
    then they are the only check. ``prefix``: only names under it (``iter_0000010/``), shown
    without it. ``stats`` gets ``manifest_files`` (and ``manifest_files_hashed`` when the
    digests were compared). ``hash_only``: the digests of only the files it accepts are
    compared (the others' sizes still are)."""
    found = manifest_for(path)
    if found is None:
        return []
    mpath, base = found
    label = mpath.name if not prefix else f"../{mpath.name}"
    try:
        algorithm, files, sizes = _read(mpath)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [_finding("error", f"unreadable manifest ({type(exc).__name__}: {exc})", label)]
    if algorithm not in ALGORITHMS:
        return [_finding("warning", f"manifest uses {algorithm!r}; only "
                         f"{' and '.join(ALGORITHMS)} are checked", label)]
    names = sorted(n for n in files if n.startswith(prefix))
    # (on an object store only with ``deep``: without it only metadata is fetched)
    hash_them = deep or (sizes is None and not is_remote(base))
    out: list[Finding] = []
    present = []
    for name in names:
        shown = name[len(prefix):]
        f = base / name
        if ".." in Path(name).parts or Path(name).is_absolute():
            out.append(_finding("error", f"manifest names a path outside the checkpoint: "
                                f"{name!r}", label))
            continue
        try:
            size = file_size(f)
        except OSError:
            out.append(_finding("error", f"file listed in {mpath.name} is missing", shown))
            continue
        want = None if sizes is None else sizes.get(name)
        if want is not None and int(want) != size:
            out.append(_finding("error", f"{size} bytes, but {mpath.name} records {want} "
                                "(changed or truncated after it was written)", shown))
            continue
        present.append(name)
    if hash_them:
        if hash_only is not None:
            present = [n for n in present if hash_only(base / n)]
        try:
            got = _digest_all(base, present, algorithm)
        except OSError as exc:
            return out + [_finding("error", f"cannot read a listed file ({exc.strerror})",
                                   label)]
        for name, (_size, digest) in zip(present, got):
            if digest != str(files[name]).lower():
                out.append(_finding(
                    "error", f"{algorithm} {digest[:16]} does not match {mpath.name} "
                    f"({str(files[name])[:16]}): the file's bytes changed after it was written",
                    name[len(prefix):]))
    scope = base / prefix if prefix else base
    listed = {n[len(prefix):] for n in names}
    # Megatron-Core's own integrity.json (no sizes) lists the directory's top-level files only
    # (``save_integrity_manifest``): what sits in a subdirectory (Megatron-LM's tokenizer/
    # assets, written after it) was never meant to be listed
    extra = [n for n in _files(scope) if n not in listed and (sizes is not None or "/" not in n)]
    for name in extra[:5]:
        out.append(_finding("warning", f"not listed in {mpath.name} (added after it was "
                            "written?)", name))
    if stats is not None:
        stats["manifest_files"] = len(names)
        if hash_them:
            stats["manifest_files_hashed"] = len(present)
    return out
