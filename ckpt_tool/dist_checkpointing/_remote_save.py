"""``save`` to an ``s3://`` or ``msc://`` checkpoint directory (``ckpt_tool.storage``).

Every rank saves into a local spool directory of its own (``CKPT_SPOOL_DIR``, else the
system's temporary directory) exactly as to a local path; then every rank uploads its data
files, and, once all have, rank 0 uploads the manifest and the markers (``.metadata``, then
``metadata.json``, last): the order and the run marker of ``ckpt_tool.storage.writing``, so
a reader never sees a checkpoint that looks complete before it is, and a killed save leaves a
run marker that ``ckpt validate`` reports and the next save to the same place reclaims. As
Megatron-Core does on a local path, an old checkpoint at the target is replaced: rank 0
deletes it (its markers first) before anything is written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ckpt_tool._torchrun import group_initialized
from ckpt_tool.errors import CheckpointingException
from ckpt_tool.storage import as_path

__all__ = ["save_remote"]


def _rank() -> int:
    return torch.distributed.get_rank() if group_initialized() else 0


def _all_ok(ok: bool) -> bool:
    if not group_initialized():
        return ok
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    torch.distributed.all_reduce(flag)
    return int(flag.item()) == 0


def save_remote(local_save: Callable[[str], Any], checkpoint_dir: str) -> Optional[Any]:
    """Run ``local_save(spool_dir)`` (``serialization.save`` to a local directory), then
    upload (see the module docstring); for an async save (an ``AsyncRequest`` returned) the
    upload is the request's last finalize function."""
    from ckpt_tool.storage.writing import (delete_output, exists, reclaim_remote,
                                           remote_target_lock)

    target = as_path(checkpoint_dir)
    lock_cm = lock = None
    ok = True
    if _rank() == 0:
        try:
            lock_cm = remote_target_lock(target)
            lock = lock_cm.__enter__()
            reclaim_remote(target, keep_output=exists(target))
            if exists(target):
                delete_output(target)
        except BaseException:
            ok = False
            if lock_cm is not None:
                lock_cm.__exit__(None, None, None)
            if not group_initialized():
                raise
            lock_cm = None
    if not _all_ok(ok):
        raise CheckpointingException(f"rank 0 could not take the save target {target}")
    spool = tempfile.mkdtemp(prefix="ckpt-spool-", dir=os.environ.get("CKPT_SPOOL_DIR") or None)

    def finish(exc: BaseException | None) -> None:
        shutil.rmtree(spool, ignore_errors=True)
        if lock_cm is not None:
            lock_cm.__exit__(type(exc) if exc else None, exc, None)

    try:
        request = local_save(spool)
    except BaseException as exc:
        finish(exc)
        raise

    def finalize() -> None:
        try:
            _upload(Path(spool), target, lock)
        except BaseException as exc:
            finish(exc)
            raise
        finish(None)

    if request is None:  # a synchronous save: upload now
        finalize()
        return None
    request.finalize_fns.append(finalize)
    return request


def _upload(spool: Path, target: Any, lock: Any) -> None:
    """Every rank its data files, then (after all) rank 0 the markers; on a failure on any
    rank, rank 0 deletes what was uploaded and every rank raises."""
    from ckpt_tool.storage.writing import delete_output, is_marker, reclaim_remote, upload_order

    names = [p.relative_to(spool).as_posix() for p in sorted(spool.rglob("*")) if p.is_file()]
    data = [n for n in names if not is_marker(n)]
    markers = upload_order([n for n in names if is_marker(n)])
    error: BaseException | None = None
    try:
        _put(spool, target, data)
    except BaseException as exc:  # noqa: BLE001 - agreed on below
        error = exc
    ok = _all_ok(error is None)
    if ok and _rank() == 0:
        try:
            for phase in markers:
                _put(spool, target, phase)
        except BaseException as exc:  # noqa: BLE001
            error, ok = exc, False
    ok = _all_ok(ok)
    if not ok:
        if _rank() == 0:
            try:
                delete_output(target)
                reclaim_remote(target, keep_output=True)
            except BaseException:  # noqa: BLE001 - the next save reclaims it
                if lock is not None:
                    lock.keep = True
        if error is not None:
            raise error
        raise CheckpointingException(f"another rank failed to upload its part of {target}")


def _put(spool: Path, target: Any, names: list[str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = target.store
    with ThreadPoolExecutor(8, thread_name_prefix="ckpt-upload") as pool:
        futures = [pool.submit(store.put_file, (target / n).key, spool / n,
                               os.path.getsize(spool / n)) for n in names]
        for f in futures:
            f.result()

