"""What the streaming file writers share: tensors cut into bounded pieces, pulled from the
source one at a time, and the work split over ranks (safetensors, torch.save, zarr writers)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterator

from ckpt_tool.errors import CorruptCheckpointError, UsageError
from ckpt_tool.formats.writer import WriteRequest
from ckpt_tool.model import TensorMeta, dtype_itemsize

__all__ = ["DEFAULT_MAX_MEMORY", "slab_pieces", "pull_piece", "tensor_bytes", "my_share",
           "run_share", "run_tasks"]

DEFAULT_MAX_MEMORY = 256 * 2**20


def slab_pieces(shape: tuple[int, ...], itemsize: int, budget: int
                ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` pieces covering ``shape`` in C order, each contiguous in the C-order
    layout and at most ``budget`` bytes (one element at least).

    The pieces are slabs along the first dim whose trailing block fits the budget: rows of
    dim 0 when a row fits, else rows of dim 1 inside each index of dim 0, and so on.
    """
    shape = tuple(int(s) for s in shape)
    if not shape or math.prod(shape) == 0:
        yield (0,) * len(shape), shape
        return
    budget = max(int(budget), itemsize)
    d = 0
    while math.prod(shape[d + 1:]) * itemsize > budget:
        d += 1
    step = max(1, budget // (math.prod(shape[d + 1:]) * itemsize))
    tail = shape[d + 1:]
    for prefix in itertools.product(*(range(s) for s in shape[:d])):
        for start in range(0, shape[d], step):
            n = min(step, shape[d] - start)
            yield prefix + (start,) + (0,) * len(tail), (1,) * d + (n,) + tail


def pull_piece(request: WriteRequest, meta: TensorMeta, offsets: tuple[int, ...],
               sizes: tuple[int, ...]) -> Any:
    """The piece from ``request.source`` as a contiguous tensor, checked against ``meta``."""
    t = request.source.read(meta.key, tuple(offsets), tuple(sizes))
    if getattr(request.source, "raw_bytes", False) and not hasattr(t, "element_size"):
        if tuple(t.shape) != tuple(sizes) or t.itemsize != dtype_itemsize(meta.dtype):
            raise CorruptCheckpointError(f"tensor {meta.key!r}: source gave {t.dtype} "
                                         f"{list(t.shape)} for the piece at {list(offsets)}")
        return t  # raw element bytes as a numpy array (a torch-free source)
    got = str(t.dtype).removeprefix("torch.")
    if tuple(t.shape) != tuple(sizes) or got != meta.dtype:
        raise CorruptCheckpointError(
            f"tensor {meta.key!r}: source gave {got} {list(t.shape)} for the piece at "
            f"{list(offsets)}, expected {meta.dtype} {list(sizes)}")
    return t.contiguous()


def tensor_bytes(t: Any) -> memoryview:
    """The raw C-order little-endian bytes of a contiguous CPU tensor or numpy array (no
    copy)."""
    if not hasattr(t, "element_size"):  # a numpy array from a torch-free source
        import numpy as np

        return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    import torch

    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def my_share(ranks: Any, sizes: list[int]) -> list[int]:
    """Indices of the items (of ``sizes`` bytes) this rank writes: all without ``ranks``,
    else its part of :func:`ckpt_tool.parallel.split_by_bytes` (the same on every rank)."""
    if ranks is None or ranks.world == 1:
        return list(range(len(sizes)))
    from ckpt_tool.parallel import split_by_bytes

    return split_by_bytes(list(enumerate(sizes)), ranks.world)[ranks.rank]


def run_share(ranks: Any, work: Callable[[], None]) -> None:
    """Run this rank's ``work``, then agree with every rank: a failure on any fails all (the
    failing rank re-raises its own error, the others a UsageError)."""
    if ranks is None or ranks.world == 1:
        work()
        return
    error: BaseException | None = None
    try:
        work()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective
        error = exc
    all_ok = ranks.all_ok(error is None)
    if error is not None:
        raise error
    if not all_ok:
        raise UsageError("another rank failed while writing the output",
                         hint="see that rank's error above")


def run_tasks(tasks: list, do: Callable[[Any], None], threads: int) -> None:
    """``do(task)`` for every task, on ``threads`` threads (the first error is raised once
    every thread has stopped; tasks not yet started are skipped)."""
    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            do(task)
        return
    import queue
    import threading

    todo: queue.SimpleQueue = queue.SimpleQueue()
    for task in tasks:
        todo.put(task)
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            try:
                task = todo.get_nowait()
            except queue.Empty:
                return
            try:
                do(task)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                errors.append(exc)

    pool = [threading.Thread(target=worker, name=f"ckpt-write-{i}", daemon=True)
            for i in range(min(threads, len(tasks)))]
    for t in pool:
        t.start()
    try:
        for t in pool:
            t.join()
    except BaseException as exc:  # Ctrl-C: stop the threads before the files go away
        errors.append(exc)
        for t in pool:
            t.join()
        raise
    if errors:
        raise errors[0]
