"""Writing an output to an object store so that no reader ever sees half of it.

An object store has no rename, so the local recipe (stage beside the target, rename) becomes:

1. **Run marker.** ``<parent>/.<name>.ckpt-writing`` (JSON: host, pid, start, heartbeat) is
   created with a conditional PUT (``If-None-Match: *``) before anything else and refreshed
   every :data:`HEARTBEAT` seconds: it is the lock (a second run for the same target is
   refused while the first is alive) and the record that objects under ``<name>/`` are an
   unfinished write.
2. **Data first, completion marker last.** The output is written completely into a local spool
   directory (the writers, the integrity manifest, the verification all work there, as for a
   local target), then uploaded: the data objects, then the manifest, then DCP's ``.metadata``,
   then Megatron-Core's ``metadata.json``, and the save directory's tracker file
   (``latest_checkpointed_iteration.txt``) last. Megatron-Core and DCP readers treat a
   directory without its marker as no checkpoint; a single-file output appears whole when its
   (multipart) upload completes. Each phase finishes before the next starts.
3. **Failure.** A failed or interrupted upload aborts its open multipart uploads, deletes what
   it put under ``<name>/`` and then the run marker. A run killed before that leaves the
   marker: ``inspect``/``validate`` report the leftovers (objects, open multipart uploads) and
   the next run for the target reclaims them, when the marker's run is gone (its pid is dead on
   this host, or its heartbeat is older than :data:`STALE`).

Rejected: a staging prefix and a server-side copy into place. The copy costs as much server
time as the upload itself (and one more request per object, and multipart copies beyond
5 GiB), while the completion marker already gives readers the all-or-nothing view.

``--overwrite`` on an object store deletes the old checkpoint (its markers first, so it stops
looking complete at once) just before the new one is uploaded: there is no rename to swap them.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from ckpt_tool.errors import UsageError

__all__ = ["WRITING_MARK", "HEARTBEAT", "STALE", "Lock", "run_marker", "remote_leftovers",
           "describe_remote_leftovers", "remote_target_lock", "reclaim_remote", "exists",
           "upload_tree", "delete_output", "upload_order", "is_marker"]

WRITING_MARK = ".ckpt-writing"
HEARTBEAT = 60.0
STALE = 10 * 60.0
_FILE_THREADS = 8
# upload phases by file name: what a reader takes as "complete" comes last
_PHASES = (("ckpt-manifest.json", "integrity.json"), (".metadata",), ("metadata.json",),
           ("latest_checkpointed_iteration.txt",))


def run_marker(target: Any) -> Any:
    """``<parent>/.<name>.ckpt-writing`` of the object-store ``target``."""
    return target.parent / f".{target.name}{WRITING_MARK}"


def _phase(rel: str) -> tuple[int, int]:
    name = rel.rsplit("/", 1)[-1]
    for i, names in enumerate(_PHASES):
        if name in names or (names == (".metadata",) and name.endswith(".metadata")
                             and name.startswith("__")):
            return i + 1, -rel.count("/")  # deeper markers before shallower ones
    if name.endswith(".index.json"):  # a sharded safetensors index names its shards
        return 1, 0
    return 0, 0


def is_marker(rel: str) -> bool:
    """Whether the output file ``rel`` is one a reader takes as (part of) "complete": it is
    uploaded after every data file."""
    return _phase(rel)[0] > 0


def upload_order(names: list[str]) -> list[list[str]]:
    """``names`` (relative paths of the output's files) in upload phases (see the module
    docstring): each phase is uploaded whole before the next starts."""
    phases: dict[tuple[int, int], list[str]] = {}
    for n in names:
        phases.setdefault(_phase(n), []).append(n)
    return [sorted(phases[k]) for k in sorted(phases)]


def _read_marker(marker: Any) -> dict[str, Any] | None:
    try:
        doc = json.loads(marker.read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _alive(doc: dict[str, Any]) -> bool:
    """Whether the run that wrote the marker ``doc`` may still be writing."""
    if doc.get("host") == socket.gethostname() and isinstance(doc.get("pid"), int):
        try:
            os.kill(doc["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return doc["pid"] != os.getpid()  # this process's own: an earlier, failed write
    beat = doc.get("heartbeat")
    return isinstance(beat, (int, float)) and time.time() - beat < STALE


def _objects_under(target: Any) -> list[tuple[str, int]]:
    return list(target.store.walk(target.key))


def _open_uploads(target: Any) -> list[tuple[str, str]]:
    """The multipart uploads open under ``target``; none when the store does not let us
    list them (a policy without ``s3:ListBucketMultipartUploads``)."""
    from ckpt_tool.errors import CkptError

    try:
        return target.store.open_uploads(target.key)
    except CkptError:
        return []


def exists(target: Any) -> bool:
    """Whether ``target`` holds an output (an object, or objects under ``target/``) that is
    not the leftovers of an unfinished write."""
    if run_marker(target).is_file():
        return target.is_file()
    return target.is_file() or bool(next(iter(target.store.walk(target.key)), None))


def remote_leftovers(target: Any) -> list[Any]:
    """What an unfinished write to ``target`` left: its run marker first, then the objects
    under ``target/``; empty when there is no run marker."""
    marker = run_marker(target)
    if not marker.is_file():
        return []
    from ckpt_tool.storage.object_path import ObjectPath

    return [marker] + [ObjectPath(target.spec, k) for k, _ in _objects_under(target)]


def describe_remote_leftovers(found: list[Any]) -> str:
    """One phrase for :func:`remote_leftovers`: who left them, how many objects, how big."""
    marker = found[0]
    target = marker.parent / marker.name[1:-len(WRITING_MARK)]
    doc = _read_marker(marker) or {}
    objs = _objects_under(target)
    uploads = _open_uploads(target)
    who = f"pid {doc.get('pid', '?')} on {doc.get('host', '?')}"
    since = doc.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
        if isinstance(since, (int, float)) else ""
    text = (f"{marker.name} (run {who}{when}: {len(objs)} objects, "
            f"{sum(s for _, s in objs) / 2**20:.1f} MiB")
    if uploads:
        text += f", {len(uploads)} open multipart upload{'s' if len(uploads) > 1 else ''}"
    return text + ")"


class _Heartbeat:
    def __init__(self, marker: Any, doc: dict[str, Any]):
        self.marker, self.doc = marker, doc
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ckpt-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            self.doc["heartbeat"] = time.time()
            with contextlib.suppress(Exception):  # a missed beat: the next one may pass
                self.marker.store.put_bytes(self.marker.key, json.dumps(self.doc).encode())


class Lock:
    """The held run marker; ``keep`` (set when a failed write could not remove what it
    uploaded) leaves the marker in place for the next run to find and reclaim."""

    def __init__(self, marker: Any):
        self.marker = marker
        self.keep = False


@contextlib.contextmanager
def remote_target_lock(target: Any) -> Iterator[Lock]:
    """Hold the run marker of ``target`` for the duration (UsageError, exit 2, when a live
    run holds it; a dead run's marker is taken over, its leftovers are for
    :func:`reclaim_remote`). The marker is deleted at the end, once the output is complete or
    removed (unless ``Lock.keep``)."""
    marker = run_marker(target)
    now = time.time()
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now,
           "target": str(target)}
    store = marker.store
    if not store.put_bytes(marker.key, json.dumps(doc).encode(), if_absent=True):
        held = _read_marker(marker) or {}
        if held and _alive(held):
            raise UsageError(
                f"another ckpt run (pid {held.get('pid', '?')} on {held.get('host', '?')}) is "
                "writing this output", path=target,
                hint=f"wait for it to finish, or choose another output; if that run is gone, "
                     f"delete {marker}")
        store.put_bytes(marker.key, json.dumps(doc).encode())  # the dead run's: taken over
    lock = Lock(marker)
    beat = _Heartbeat(marker, doc)
    try:
        yield lock
    finally:
        beat.stop.set()
        beat.thread.join()
        if not lock.keep:
            with contextlib.suppress(Exception):  # left behind: reported, reclaimed next time
                store.delete([marker.key])


def reclaim_remote(target: Any, *, keep_output: bool = False) -> str | None:
    """Remove what an unfinished write to ``target`` left (call with the lock held): open
    multipart uploads under it and, unless ``keep_output``, the objects under ``target/``.
    Returns a note saying what was reclaimed, or None."""
    store = target.store
    uploads = _open_uploads(target)
    objs = [] if keep_output else _objects_under(target)
    if not uploads and not objs:
        return None
    for key, upload_id in uploads:
        store.abort_upload(key, upload_id)
    if objs:
        store.delete([k for k, _ in objs])
    parts = []
    if objs:
        parts.append(f"{len(objs)} objects ({sum(s for _, s in objs) / 2**20:.1f} MiB)")
    if uploads:
        parts.append(f"{len(uploads)} open multipart upload{'s' if len(uploads) > 1 else ''}")
    return f"reclaimed what an interrupted run left at the output: {' and '.join(parts)}"


def delete_output(target: Any) -> None:
    """Delete the output at ``target``: its completion markers first (it stops looking
    complete at once), then the rest."""
    keys = [k for k, _ in _objects_under(target)]
    if target.is_file():
        keys.append(target.key)
    order = upload_order([k for k in keys])
    for phase in reversed(order):
        if phase:
            target.store.delete(phase)


def upload_tree(staging: Path, target: Any, lock: Lock, file_name: str | None = None,
                side: Path | None = None) -> None:
    """Upload the spooled output: the directory ``staging`` as the objects under
    ``target/`` in :func:`upload_order`, or (``file_name``) the single file
    ``staging/file_name`` as the object ``target``, after its manifest ``side`` (uploaded
    beside it first). On failure what was uploaded is deleted before the error goes on (when
    that fails too, ``lock.keep``: the next run reclaims it)."""
    store = target.store
    if file_name:
        jobs = [[(side, (target.parent / side.name).key)]] if side is not None else []
        jobs.append([(staging / file_name, target.key)])
    else:
        names = [p.relative_to(staging).as_posix() for p in sorted(staging.rglob("*"))
                 if p.is_file()]
        jobs = [[(staging / n, (target / n).key) for n in phase] for phase in upload_order(names)]

    def one(job: tuple[Path, str]) -> None:
        path, key = job
        store.put_file(key, path, os.path.getsize(path))

    pool = ThreadPoolExecutor(_FILE_THREADS, thread_name_prefix="ckpt-upload")
    try:
        for phase in jobs:
            for f in [pool.submit(one, j) for j in phase]:
                f.result()  # the first error is raised; the phase's others finish or fail
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # nothing uploads behind the cleanup
        try:
            if file_name:
                if side is not None and not target.is_file():
                    store.delete([(target.parent / side.name).key])
            else:
                delete_output(target)
            reclaim_remote(target, keep_output=True)
        except BaseException:  # noqa: BLE001 - the upload's error is the one to report
            lock.keep = True
        raise
    finally:
        pool.shutdown(wait=True)
