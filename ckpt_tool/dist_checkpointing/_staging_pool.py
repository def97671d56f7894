"""Host staging memory reused across async saves (:class:`FileSystemWriterAsync`).

An async save copies every tensor it writes into one segment leased from this process's pool:
a shared-memory file (a persistent writer process maps it instead of receiving copies; a forked
one inherits the mapping), registered as pinned memory when CUDA is present, so the
device-to-host copies are non-blocking and one synchronisation ends the staging. The lease gives
the segment back when the save is finalized (or its writer is garbage collected) and the next
save reuses it: after the first save, staging costs only the copy. A larger state replaces the
free segments (released before the new one is made, so pinned memory stays near the staged
bytes); saves that overlap (one scheduled before the previous was finalized) each hold their own,
and once none is in flight the pool keeps only the largest segment.
Where ``/dev/shm`` cannot hold a segment, a private (pinned) buffer stands in; a persistent
writer then receives copies.

Call order::

    lease = staging_pool().lease(staged_nbytes(tensors))
    host = lease.copy_in(tensors)    # host views, in order; returns once they hold the values
    ... write ``host`` (here, in a forked child, or in a process that attaches the segment) ...
    lease.release()                  # at finalize: the segment goes back to the pool
    release_staging_memory()         # at close and at exit: unpin, unmap, unlink free segments
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from typing import List, Optional, Sequence

import torch

from ._staging import SEGMENT_PREFIX, SharedSegment, _shm_dir

__all__ = ["StagingLease", "StagingPool", "staging_pool", "release_staging_memory",
           "staged_nbytes", "exact_storage"]

_ALIGN = 256
_GROWTH_SLACK = 0.05  # a grown segment holds 5% more, so slow growth does not re-pin each save


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def staged_nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of one segment holding ``tensors`` at aligned offsets."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


class _PrivateSegment:
    """A process-private host buffer with :class:`SharedSegment`'s interface (no path)."""

    path = None

    def __init__(self, nbytes: int, pin: bool):
        self.nbytes = nbytes
        self.pinned = pin and torch.cuda.is_available()
        self.base = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pinned)

    def pin(self) -> bool:
        return self.pinned  # pinned at allocation or never

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch._utils._element_size(dtype)
        return self.base[offset:offset + n].view(dtype).view(shape)

    def close(self) -> None:
        self.base = None


def _shm_has_room(nbytes: int) -> bool:
    try:
        st = os.statvfs(_shm_dir())
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= nbytes + (64 << 20)


def _new_segment(nbytes: int, pin: bool):
    if _shm_has_room(nbytes):
        try:
            return SharedSegment.create(nbytes, pin=pin)
        except OSError:
            pass
    return _PrivateSegment(nbytes, pin)


def _reclaim_dead_segments() -> None:
    """Remove staging files whose creating process is gone (killed before it cleaned up)."""
    directory = _shm_dir()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        try:
            pid = int(name[len(SEGMENT_PREFIX):].split("_", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
        except PermissionError:  # alive, another user's
            continue


class StagingLease:
    """One save's hold on a pool segment; :meth:`release` gives it back (idempotent)."""

    def __init__(self, pool: "StagingPool", segment) -> None:
        self._pool, self.segment = pool, segment

    def copy_in(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Host copies of ``tensors`` in the segment, in order; they hold the values when this
        returns (device copies are queued non-blocking, then each device is synchronised once)."""
        out: List[torch.Tensor] = []
        devices = set()
        offset = 0
        for t in tensors:
            t = t.detach()
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                out.append(torch.empty(t.shape, dtype=t.dtype))
                continue
            dst = self.segment.view(offset, tuple(t.shape), t.dtype)
            if t.device.type == "cuda":
                devices.add(t.device)
                dst.copy_(t, non_blocking=self.segment.pinned)
            else:
                dst.copy_(t)
            out.append(dst)
            offset += _aligned(nbytes)
        for device in devices:
            torch.cuda.synchronize(device)
        return out

    def release(self) -> None:
        if self.segment is not None:
            segment, self.segment = self.segment, None
            self._pool._give_back(segment)


class StagingPool:
    """The segments of this process: leased (in use by a save) or free (reusable)."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin  # False: never pin (pinning also needs CUDA and a lease that asks)
        self._free: list = []
        self._leased = 0
        self._lock = threading.Lock()

    def lease(self, nbytes: int, pin: bool = False) -> StagingLease:
        """A segment of at least ``nbytes`` for one save (a free one when big enough), pinned
        when ``pin`` (for device copies; pinning starts a CUDA context, so only then)."""
        pin = pin and self.pin and torch.cuda.is_available()
        with self._lock:
            fitting = [s for s in self._free if s.nbytes >= nbytes
                       and (s.pinned or not pin or s.path is not None)]
            if fitting:
                segment = min(fitting, key=lambda s: s.nbytes)
                self._free.remove(segment)
            else:
                for s in self._free:  # too small: release before growing
                    s.close()
                self._free.clear()
                segment = None
            self._leased += 1
        try:
            if segment is None:
                segment = _new_segment(int(nbytes * (1 + _GROWTH_SLACK)) if nbytes else 0, pin)
            elif pin:
                segment.pin()
        except BaseException:
            with self._lock:
                self._leased -= 1
            raise
        return StagingLease(self, segment)

    def _give_back(self, segment) -> None:
        extra = []
        with self._lock:
            self._leased -= 1
            self._free.append(segment)
            if self._leased == 0 and len(self._free) > 1:  # overlapping saves are over:
                self._free.sort(key=lambda s: s.nbytes)    # keep one segment, the largest
                extra, self._free = self._free[:-1], self._free[-1:]
        for s in extra:
            s.close()

    @property
    def free_nbytes(self) -> int:
        return sum(s.nbytes for s in self._free)

    @property
    def leased(self) -> int:
        return self._leased

    def release_free(self) -> None:
        """Unpin, unmap and unlink every free segment (leased ones stay with their saves)."""
        with self._lock:
            free, self._free = self._free, []
        for s in free:
            s.close()


_POOL: Optional[StagingPool] = None
_POOL_PID: Optional[int] = None
_POOL_LOCK = threading.Lock()


def staging_pool() -> StagingPool:
    """This process's pool (a forked child gets a fresh one, never its parent's segments)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            if _POOL is None:
                atexit.register(release_staging_memory)
                _reclaim_dead_segments()
            _POOL, _POOL_PID = StagingPool(), os.getpid()
        return _POOL


def release_staging_memory() -> None:
    """Release the free staging segments of this process (see :meth:`StagingPool.release_free`)."""
    if _POOL is not None and _POOL_PID == os.getpid():
        _POOL.release_free()


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a contiguous host tensor) on a storage of exactly its bytes, without a copy.

    ``torch.save`` writes a tensor's whole storage; a view into a staging segment would write
    the segment. The result borrows ``t``'s memory: keep ``t`` alive while it is used.
    """
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() == nbytes or nbytes == 0:
        return t
    if not t.is_contiguous() or t.device.type != "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    raw = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape)
