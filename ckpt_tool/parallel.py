"""Running one command over K processes (``torchrun --nproc-per-node K -m ckpt_tool …``).

Every rank runs the same command; work is split by bytes with :func:`split_by_bytes` (pure,
deterministic: every rank computes the same assignment without talking); results are gathered
to rank 0, which alone prints. Without torchrun everything degenerates to one rank and no
process group is ever created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence, TypeVar

from ckpt_tool._pause_points import pause_point

__all__ = ["Ranks", "ranks", "split_by_bytes", "under_torchrun", "JobProgress"]

T = TypeVar("T", bound=Hashable)


def under_torchrun() -> bool:
    """True when launched by torchrun with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job and the few collectives commands need (gloo, CPU)."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (a list in rank order); None on the others."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world if self.is_main else None
        dist.gather_object(value, out, dst=0)
        return out

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        """True on every rank only when ``ok`` is true on every rank."""
        if self.world == 1:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item()) == 0


class JobProgress:
    """Forwards bytes written to a progress sink; under torchrun the sink shows what every
    rank wrote (a counter in the job's store: one cheap ``add`` per piece)."""

    _instances = 0  # every rank creates them in the same order: the same key per operation

    def __init__(self, progress: Any, r: Ranks):
        self.progress = progress
        self.local = 0
        self._seen = 0
        self._store = None
        if progress is not None and r.world > 1:
            import torch.distributed.distributed_c10d as c10d

            JobProgress._instances += 1
            self._store = c10d._get_default_store()
            self._key = f"ckpt/progress/{JobProgress._instances}"

    def update(self, nbytes: int, tensors_done: int = 0) -> None:
        self.local += nbytes
        pause_point("writing")
        if self.progress is None:
            return
        if self._store is None:
            self.progress.update(nbytes, tensors_done)
            return
        self._forward(int(self._store.add(self._key, int(nbytes))), tensors_done)

    def catch_up(self, tensors_done: int = 0) -> None:
        """After a barrier: add the other ranks' last pieces to the sink."""
        if self._store is not None:
            self._forward(int(self._store.add(self._key, 0)), tensors_done)

    def _forward(self, total: int, tensors_done: int) -> None:
        self.progress.update(max(0, total - self._seen), tensors_done)
        self._seen = max(self._seen, total)


def ranks() -> Ranks:
    """This process's ``Ranks``; initialises a gloo process group under torchrun (once) and
    registers the exit handler that lets gloo's workers go idle before the interpreter
    finalizes (:func:`ckpt_tool._torchrun.register_exit_teardown`)."""
    if not under_torchrun():
        return Ranks()
    import torch.distributed as dist

    from ckpt_tool._torchrun import register_exit_teardown

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    # a library script ending without destroy_process_group must not abort at exit
    register_exit_teardown()
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size())


def split_by_bytes(items: Iterable[tuple[T, int]], world: int) -> list[list[T]]:
    """Assign ``(item, nbytes)`` pairs to ``world`` ranks so bytes are balanced.

    Largest first onto the least-loaded rank (ties: lowest rank), then each rank's items in their
    original order. Pure and deterministic, so every rank computes the same split.
    """
    items = list(items)
    order = sorted(range(len(items)), key=lambda i: (-items[i][1], i))
    load = [0] * world
    owner: dict[int, int] = {}
    for i in order:
        r = min(range(world), key=lambda k: (load[k], k))
        owner[i] = r
        load[r] += items[i][1]
    out: list[list[T]] = [[] for _ in range(world)]
    for i, (item, _n) in enumerate(items):
        out[owner[i]].append(item)
    return out


def mine(items: Sequence[tuple[T, int]], r: Ranks) -> list[T]:
    """This rank's share of ``items`` (all of them on a single rank)."""
    if r.world == 1:
        return [item for item, _ in items]
    return split_by_bytes(items, r.world)[r.rank]
