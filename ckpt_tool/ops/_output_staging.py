"""Atomic output directories: write into a staging directory beside the target, add its
integrity manifest (``ckpt_tool.integrity_manifest``), fsync, rename.

A killed run leaves only ``.<name>.ckpt-staging-*`` beside the target (which ``ckpt validate``
reports as a leftover), never a directory at the target path that looks complete. Replacing
an existing target (``--overwrite``) exchanges the new output and the old one in one atomic
step where the file system can (``renameat2(RENAME_EXCHANGE)``: Linux, local file systems),
so the target is never missing; elsewhere the old output is parked beside the target
(``.<name>.ckpt-old-*/old``) for the moment between two renames, and only deleted once the
new one is in place. A run killed in that moment leaves the old output parked: ``validate``
and ``inspect`` say how to put it back, and the next run for the target puts it back before
anything else (``ckpt_tool.leftovers.reclaim``).

An object-store target (``s3://``, ``msc://``) is written in a local spool directory the same
way, then uploaded data first and completion marker last under a run marker
(``ckpt_tool.storage.writing``): :func:`staged_output` hides the difference from the writers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from ckpt_tool._pause_points import pause_point
from ckpt_tool._program import cleanup_on_stop, committing
from ckpt_tool.errors import OutputError, UsageError, plural
from ckpt_tool.digests import take as take_digests
from ckpt_tool.leftovers import (OLD_MARK, PARKED_NAME, STAGING_MARK, reclaim, side_prefix,
                                 target_lock)
from ckpt_tool.integrity_manifest import current_umask, fsync_dir
from ckpt_tool.storage import as_path, is_remote

__all__ = ["check_output_target", "staged_output", "staged_output_ranks", "fsync_tree",
           "verify_output", "output_estimate"]

def check_output_target(dst: str | Path, *, sources: tuple[str | Path, ...] = (),
                        overwrite: bool = False) -> Path:
    """Refuse an existing ``dst`` (unless ``overwrite``) and a ``dst`` inside (or equal to, or
    containing) any source. Returns ``dst`` as an absolute path (an ``ObjectPath`` for an
    object-store target)."""
    if is_remote(dst):
        return _check_remote_target(as_path(dst), sources, overwrite)
    out = Path(os.path.abspath(dst))
    for src in sources:
        if is_remote(src):
            continue
        s = Path(os.path.realpath(src))
        real_out = Path(os.path.realpath(out))
        if real_out == s or s in real_out.parents:
            raise UsageError("the output is inside the input checkpoint", path=out,
                             hint="write the output somewhere outside the source")
        if real_out in s.parents:
            raise UsageError("the output directory contains the input checkpoint", path=out,
                             hint="choose another output path")
    if os.path.lexists(out) and not overwrite:
        raise UsageError("the output already exists", path=out,
                         hint="pass --overwrite to replace it, or choose another path")
    if os.path.lexists(out):
        _check_replaceable(out)
    if not out.parent.is_dir():
        raise UsageError("the output's parent directory does not exist", path=out.parent,
                         hint="create it first")
    return out


def _check_replaceable(out: Path) -> None:
    """``--overwrite`` replaces only a checkpoint (one ckpt recognizes, a training save
    directory, or an output ckpt wrote: its integrity manifest is there) or an empty directory; anything else (a
    directory of someone's files, a file of another kind) is refused by name, untouched."""
    from ckpt_tool.errors import CkptError
    from ckpt_tool.formats.base import detect
    from ckpt_tool.formats.save_dir import LATEST_FILE
    from ckpt_tool.integrity_manifest import FILE_SUFFIX, SIDECAR

    if os.path.isdir(out):
        try:
            names = sorted(os.listdir(out))
        except OSError:
            names = None
        if names == [] or (names and {SIDECAR, "integrity.json", LATEST_FILE} & set(names)):
            return  # empty; an output ckpt wrote; a training save directory (its tracker)
    elif os.path.lexists(str(out) + FILE_SUFFIX):
        return
    try:
        detect(out)
        return
    except CkptError:
        pass
    if os.path.isdir(out):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                        else "") if names else "entries that cannot be listed"
        what = f"a directory that is not a checkpoint (it holds {shown})"
    else:
        what = "a file that is not a checkpoint"
    raise UsageError(f"--overwrite replaces only a checkpoint or an empty directory: the output "
                     f"is {what}", path=out,
                     hint="remove it yourself if it is to go, or choose another output path")


def _check_remote_target(out: Any, sources: tuple[str | Path, ...], overwrite: bool) -> Any:
    from ckpt_tool.storage.writing import exists

    if not out.key:
        raise UsageError("the output must be a prefix inside the bucket, not the bucket itself",
                         path=out, hint="add a name: s3://bucket/NAME")
    for src in sources:
        s = as_path(src)
        if not is_remote(s) or s.spec.bucket != out.spec.bucket \
                or s.spec.endpoint_url != out.spec.endpoint_url:
            continue
        if s == out or s in out.parents:
            raise UsageError("the output is inside the input checkpoint", path=out,
                             hint="write the output somewhere outside the source")
        if out in s.parents:
            raise UsageError("the output prefix contains the input checkpoint", path=out,
                             hint="choose another output path")
    if not overwrite and exists(out):
        raise UsageError("the output already exists", path=out,
                         hint="pass --overwrite to replace it, or choose another path")
    return out


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def staged_output(dst: str | Path, *, overwrite: bool = False,
                  file_name: str | None = None, notes: list[str] | None = None,
                  need_bytes: int = 0, inner: str | None = None) -> Iterator[Path]:
    """Yield an empty staging directory beside ``dst``; on success fsync it and rename it to
    ``dst`` (replacing an existing ``dst`` only when ``overwrite``); on failure remove it.

    With ``file_name`` the output is a single file: the writer creates ``staging/file_name``,
    which becomes ``dst``. ``inner``: the output is a container (``ops._container``) whose
    dist checkpoint lies in ``staging/inner``, which gets the integrity manifest. The
    target's lock is held throughout (another live run writing the same target:
    UsageError); what killed runs left beside ``dst`` is reclaimed first, with a note
    appended to ``notes``. ``need_bytes``: about what the output takes; less free space
    on the target's file system is an OutputError before anything is written, and running
    out of space (or into a file size limit) while writing is one too, staging removed.
    A previous output that a killed run left parked beside a missing ``dst`` is put back
    first; without ``overwrite`` the run then stops (UsageError: the output exists).
    An object-store ``dst``: :func:`_remote_staged`."""
    if is_remote(dst):
        with _remote_staged(as_path(dst), overwrite, file_name, notes, inner) as staging:
            yield staging
        return
    out = Path(os.path.abspath(dst))
    with target_lock(out):
        note, restored = reclaim(out)
        if note and notes is not None:
            notes.append(note)
        if restored and not overwrite:
            raise UsageError("the output already exists (a run killed while replacing it had "
                             "moved it aside; it is back in place)", path=out,
                             hint="pass --overwrite to replace it, or choose another path")
        _check_space(out, need_bytes)
        try:
            with _staged(out, overwrite, file_name, inner) as staging:
                yield staging
        except (OSError, RuntimeError) as exc:
            if not _out_of_space(exc, out):
                raise
            if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
                raise OutputError(
                    f"a file of the output exceeds the file size limit ({exc.strerror}"
                    f"{': ' + str(exc.filename) if exc.filename else ''}); nothing was written", path=out,
                    hint="raise the limit (ulimit -f) or write the output elsewhere") from None
            raise OutputError(
                f"no space left for the output ({_space_text(out, need_bytes)}); nothing was "
                "written", path=out, hint="free some space, or write the output elsewhere"
            ) from None


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def output_estimate(meta: Any) -> int:
    """About what an output of the checkpoint ``meta`` takes on disk: its tensor bytes plus
    the zip/header overhead of each stored piece (a few KiB each) and 1 MiB of metadata.
    (The check it feeds runs before writing: torch's C++ zip writer aborts the process when
    the disk fills under it, which no handler can turn into a clean error.)"""
    pieces = sum(len(t.chunks) for t in meta.tensors.values()) + len(meta.objects)
    return int(meta.total_bytes) + 4096 * pieces + (1 << 20)


def _free(out: Path) -> int | None:
    try:
        return shutil.disk_usage(out.parent).free
    except OSError:
        return None


def _space_text(out: Path, need: int) -> str:
    free = _free(out)
    need_text = f"needs about {need / 2**20:.1f} MiB, " if need else ""
    return need_text + ("free space unknown" if free is None else
                        f"{free / 2**20:.1f} MiB free on its file system")


def _check_space(out: Path, need: int) -> None:
    free = _free(out)
    if need and free is not None and free < need:
        raise OutputError(f"not enough space for the output ({_space_text(out, need)})",
                          path=out, hint="free some space, or write the output elsewhere")


def _out_of_space(exc: BaseException, out: Path) -> bool:
    """ENOSPC/EDQUOT/EFBIG, also when torch's C++ zip writer reports it as a RuntimeError
    (a short write: "unexpected pos", "iostream error") on a file system that is full."""
    if isinstance(exc, OSError):
        return exc.errno in _NO_SPACE
    text = str(exc)
    if "No space left" in text or "File too large" in text:
        return True
    free = _free(out)
    return ("unexpected pos" in text or "iostream error" in text) and free is not None \
        and free < (1 << 20)


@contextlib.contextmanager
def _staged(out: Path, overwrite: bool, file_name: str | None,
            inner: str | None = None) -> Iterator[Path]:
    staging = Path(tempfile.mkdtemp(prefix=side_prefix(out, STAGING_MARK), dir=out.parent))
    try:
        with cleanup_on_stop(lambda: shutil.rmtree(staging, ignore_errors=True)):
            pause_point("staging")
            yield staging
            os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp made it 0700: the output follows umask
            produced = staging / file_name if file_name else staging
            side = _add_manifest(staging, file_name, out, inner)
            take_digests(staging)  # used by the manifest: forget them
            fsync_tree(staging)
            pause_point("fsynced")
        with committing():  # Ctrl-C waits for the renames, and is ignored once they are done
            _put_in_place(out, produced, side, overwrite)
        pause_point("renamed")
        if file_name or os.path.lexists(staging):  # (an exchange left the old output there)
            shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(out.parent)
    except BaseException:
        take_digests(staging)
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def _remote_staged(out: Any, overwrite: bool, file_name: str | None,
                   notes: list[str] | None, inner: str | None = None) -> Iterator[Path]:
    """:func:`staged_output` for an object-store target: the run marker held throughout,
    what killed runs left reclaimed first, the output spooled in a local directory
    (``CKPT_SPOOL_DIR``, else the system's temporary directory), then uploaded in order."""
    from ckpt_tool.storage.writing import (delete_output, exists, reclaim_remote,
                                           remote_target_lock, upload_tree)

    with remote_target_lock(out) as lock:
        note = reclaim_remote(out, keep_output=exists(out))
        if note and notes is not None:
            notes.append(note)
        spool = Path(tempfile.mkdtemp(prefix=f"ckpt-spool-{out.name}-",
                                      dir=os.environ.get("CKPT_SPOOL_DIR") or None))
        try:
            yield spool
            side = _add_manifest(spool, file_name, out, inner)
            take_digests(spool)
            if exists(out):
                if not overwrite:
                    raise UsageError("the output appeared while writing", path=out,
                                     hint="pass --overwrite to replace it")
                delete_output(out)
            # (interruptible: a Ctrl-C aborts the upload and removes what it put)
            upload_tree(spool, out, lock, file_name, side)
            with committing():  # complete: a later Ctrl-C is ignored
                pass
        finally:
            take_digests(spool)
            shutil.rmtree(spool, ignore_errors=True)


def _put_in_place(out: Path, produced: Path, side: Path | None, overwrite: bool) -> None:
    """Rename ``produced`` to ``out``; an existing ``out`` (``overwrite``) is exchanged with it
    atomically where possible (the old output then lies at ``produced``, inside the staging
    directory that the caller removes), else parked until the new output is in place."""
    if os.path.lexists(out) and not overwrite:
        raise UsageError("the output appeared while writing", path=out,
                         hint="pass --overwrite to replace it")
    if side is not None:  # the file's manifest goes first: the file never lacks it
        os.replace(side, out.parent / side.name)
    if not os.path.lexists(out):
        os.rename(produced, out)
    elif not exchange(produced, out):
        parking = Path(tempfile.mkdtemp(prefix=side_prefix(out, OLD_MARK), dir=out.parent))
        os.rename(out, parking / PARKED_NAME)
        fsync_dir(out.parent)
        pause_point("between-renames")
        try:
            os.rename(produced, out)
        except BaseException:
            os.rename(parking / PARKED_NAME, out)  # the old output back, as it was
            os.rmdir(parking)
            raise
        fsync_dir(out.parent)
        shutil.rmtree(parking, ignore_errors=True)  # only now: the new output is in place


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` (both exist, same directory) in one atomic step, and fsync their
    directory; False where the system or the file system cannot (then nothing changed)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        import ctypes

        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM,
                   errno.EXDEV):
            return False  # not supported here (NFS, FUSE, an old kernel): park instead
        raise OSError(err, os.strerror(err), str(b))
    fsync_dir(b.parent)
    return True


def _renameat2() -> Any:
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):  # glibc < 2.28, musl without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _add_manifest(staging: Path, file_name: str | None, out: Path,
                  inner: str | None = None) -> Path | None:
    """Write the output's integrity manifest (``ckpt_tool.integrity_manifest``) into the staging
    directory (a dist checkpoint's ``integrity.json`` into the checkpoint's directory,
    ``inner`` in a container); for a single-file output return the manifest to put beside
    it."""
    from ckpt_tool.integrity_manifest import (INTEGRITY_JSON, manifest_name, write_file_manifest,
                                              write_manifest)

    if file_name:
        return write_file_manifest(staging / file_name, as_name=out.name, into=staging)
    if inner and manifest_name(staging / inner) == INTEGRITY_JSON:
        write_manifest(staging / inner)
    else:
        write_manifest(staging)
    return None


@contextlib.contextmanager
def staged_output_ranks(dst: str | Path, ranks: Any, *, overwrite: bool = False,
                        file_name: str | None = None, notes: list[str] | None = None,
                        need_bytes: int = 0, inner: str | None = None) -> Iterator[Path]:
    """``staged_output`` for every rank of a torchrun job: rank 0 creates the staging directory
    and every rank writes into it; at the end the ranks agree (a failure on any rank fails all)
    and rank 0 alone fsyncs and renames. Single-rank jobs are plain ``staged_output``."""
    if ranks.world == 1:
        with staged_output(dst, overwrite=overwrite, file_name=file_name,
                           notes=notes, need_bytes=need_bytes, inner=inner) as staging:
            yield staging
        return
    if ranks.is_main:
        ctx = staged_output(dst, overwrite=overwrite, file_name=file_name, notes=notes,
                            need_bytes=need_bytes, inner=inner)
        try:
            staging = ctx.__enter__()
        except BaseException as exc:
            ranks.broadcast(None)
            raise exc
        ranks.broadcast(str(staging))
    else:
        got = ranks.broadcast(None)
        if got is None:
            raise UsageError("rank 0 could not create the output's staging directory")
        staging, ctx = Path(got), None
    ok = False
    try:
        yield staging
        ok = True
    finally:
        from ckpt_tool.digests import give

        try:
            all_ok = ranks.all_ok(ok)
            # the digests every rank computed while writing, for rank 0's integrity manifest
            noted = ranks.gather(take_digests(staging) if ok else {})
        except BaseException:  # a rank died or was stopped: rank 0 still removes the staging
            if ctx is not None:
                ctx.__exit__(RuntimeError, RuntimeError("a rank failed"), None)
            raise
        if ctx is not None:
            for part in noted or []:
                give(part or {})
            if all_ok:
                ctx.__exit__(None, None, None)
            else:
                ctx.__exit__(RuntimeError, RuntimeError("a rank failed"), None)
        if ok and not all_ok:
            raise UsageError("another rank failed while writing the output",
                             hint="see that rank's error above")


def verify_output(path: Path, *, trust: bool, what: str, ranks: Any = None,
                  level: Any = "written") -> None:
    """Validate what was written into the staging directory; a FindingsError (so nothing is
    renamed into place) when it has error findings. ``what``: "converted", "resharded".

    ``level`` (docs/reliability.md): ``"written"`` (also ``True``) does not read again the
    data files whose bytes were proven as they were written and are unchanged since
    (``ckpt_tool.digests.proven_files``: the CRC-32 of what each file holds, read behind the
    writer from the page cache, equals that of the bytes written, whose records' CRCs came
    from the same buffers); every other file, and every check but that byte scan, as
    ``"full"``, which reads every byte of the output back.

    ``ranks``: under torchrun every rank calls this; the byte scan is split over them and every
    rank raises on the same findings."""
    from ckpt_tool.digests import proven_files
    from ckpt_tool.errors import FindingsError
    from ckpt_tool.ops.validate import validate

    job = ranks if ranks is not None and ranks.world > 1 else None
    proven: frozenset[str] = frozenset()
    if level != "full" and Path(path).is_dir():
        mine = proven_files(path)
        if job is not None:  # every rank proved its own files: the same set on every rank
            parts = job.gather(sorted(mine))
            mine = set(job.broadcast(sorted({f for part in parts for f in part})
                                     if parts is not None else None) or ())
        proven = frozenset(mine)
    result = validate(path, trust=trust, ranks=job, proven=proven)
    if not result.ok:
        first = result.errors[0]
        raise FindingsError(
            f"the {what} checkpoint does not validate ({plural(len(result.errors), 'error')}; "
            "first: "
            f"{first.key or first.file or ''}: {first.message})",
            hint="this is a bug in ckpt: please report it; --no-verify skips the check")
