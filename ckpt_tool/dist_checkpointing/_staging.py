"""Staging for :class:`~ckpt_tool.dist_checkpointing.checkpointer.AsyncCheckpointer`.

Staging copies every tensor this rank will write into one shared-memory segment (a file under
``/dev/shm`` mapped with ``torch.from_file(shared=True)``; with CUDA also registered as pinned
host memory) that is reused by the next save when it is large enough. The staged state dict has
the caller's structure; non-tensor values are deep-copied. It crosses to the checkpoint process
as a small pickle in which each tensor is only ``(segment, offset, shape, dtype)``
(:func:`dumps_staged` / :func:`loads_staged`); the data itself is never copied again. Once the
checkpoint process has mapped the segment its file is unlinked, so even a killed process leaves
no memory behind in ``/dev/shm``.

Call order::

    stager = DefaultStager(CheckpointStagerConfig(use_async_staging=False))
    staged = stager.stage(state_dict)   # a Future with use_async_staging
    payload, segments = dumps_staged(staged)  # -> checkpoint process: loads_staged(payload, ..)
    for seg in segments:                # once it attached: only the mappings keep the memory
        seg.unlink()
    stager.close()                      # unmaps and removes the segment
"""

from __future__ import annotations

import abc
import copy
import io
import os
import pickle
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ._base import is_main_replica
from .mapping import ShardedTensor, ShardedTensorFactory

__all__ = ["CheckpointStager", "CheckpointStagerConfig", "DefaultStager", "SharedSegment",
           "dumps_staged", "loads_staged"]

STATE_DICT = Dict[str, Any]
_ALIGN = 64
SEGMENT_PREFIX = "ckpt_stage_"
_LIVE_SEGMENTS: Dict[str, "SharedSegment"] = {}  # segments this process created, by path


def _cuda() -> bool:
    return torch.cuda.is_available()


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedSegment:
    """A named, file-backed shared-memory byte buffer, mapped as a uint8 tensor.

    Other processes :meth:`attach` by path; the creator removes the file (:meth:`unlink`, at
    the latest in :meth:`close`).
    """

    def __init__(self, path: str, nbytes: int, create: bool, pin: bool = False):
        self.path, self.nbytes, self.owner = path, nbytes, create
        if create:
            with open(path, "wb") as f:
                f.truncate(max(nbytes, 1))
                if hasattr(os, "posix_fallocate"):  # no space: ENOSPC now, not SIGBUS later
                    os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
        self.base = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False
        if pin:
            self.pin()
        if create:
            _LIVE_SEGMENTS[path] = self

    @classmethod
    def create(cls, nbytes: int, pin: bool = False) -> "SharedSegment":
        name = f"{SEGMENT_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        return cls(os.path.join(_shm_dir(), name), nbytes, create=True, pin=pin)

    @classmethod
    def attach(cls, path: str, nbytes: int) -> "SharedSegment":
        return cls(path, nbytes, create=False)

    def pin(self) -> bool:
        """Register the mapping as pinned memory (CUDA only); whether it is pinned."""
        if not self.pinned and self.base is not None and _cuda():
            rc = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), self.base.numel(), 0)
            self.pinned = int(rc) == 0
        return self.pinned

    def view(self, offset: int, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * torch._utils._element_size(dtype)
        return self.base[offset:offset + n].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (creator only); mappings stay valid, so once every user has
        attached, a crash of any process can no longer leave the memory behind."""
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unpin, drop this process's mapping (once no view is left) and, if owner, unlink."""
        if self.base is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
        self.base = None
        if self.owner:
            _LIVE_SEGMENTS.pop(self.path, None)
            self.unlink()


class CheckpointStager(abc.ABC):
    """Copies a state dict off the live tensors. Call order: ``stage`` (any number), ``close``."""

    @abc.abstractmethod
    def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> STATE_DICT | Future:
        """The staged state dict, or a Future of it (asynchronous staging)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every resource of the stager (threads, shared memory)."""


@dataclass
class CheckpointStagerConfig:
    """Staging options (PyTorch's names; the CUDA ones default to whether CUDA is present).

    Attributes:
        use_pinned_memory: register the staging segment as pinned memory (CUDA only).
        use_shared_memory: stage into the shared segment; the checkpoint process of
            :class:`AsyncCheckpointer` needs it. False stages into private CPU tensors.
        use_async_staging: stage in a background thread; ``stage`` returns a Future.
        use_non_blocking_copy: device-to-host copies are non-blocking, then synchronized.
    """

    use_pinned_memory: bool = field(default_factory=_cuda)
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool = field(default_factory=_cuda)


def _tensor_slots(state_dict: Any, out: List[torch.Tensor]) -> None:
    """Every tensor the staging copies, in traversal order."""
    if isinstance(state_dict, dict):
        for v in state_dict.values():
            _tensor_slots(v, out)
    elif isinstance(state_dict, (list, tuple)):
        for v in state_dict:
            _tensor_slots(v, out)
    elif isinstance(state_dict, ShardedTensor):
        if state_dict.data is not None and is_main_replica(state_dict.replica_id):
            out.append(state_dict.data)
    elif isinstance(state_dict, ShardedTensorFactory):
        out.append(state_dict.data)
    elif isinstance(state_dict, torch.Tensor):
        out.append(state_dict)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class DefaultStager(CheckpointStager):
    """Stages into one reusable shared-memory segment (see the module docstring).

    Only main replicas of ShardedTensors are copied (the others are what another rank writes:
    they are staged without data). Not thread-safe; one save at a time.
    """

    def __init__(self, config: Optional[CheckpointStagerConfig] = None):
        self._config = config or CheckpointStagerConfig()
        if self._config.use_non_blocking_copy and not _cuda():
            raise ValueError("use_non_blocking_copy needs CUDA")
        self._segment: Optional[SharedSegment] = None
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
                          if self._config.use_async_staging else None)

    @property
    def segment(self) -> Optional[SharedSegment]:
        """The current staging segment (None before the first shared-memory staging)."""
        return self._segment

    def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> STATE_DICT | Future:
        """Stage ``state_dict``; a Future of the result with ``use_async_staging``.

        The previous staged state dict must no longer be in use (its memory is reused).
        """
        if self._executor is not None:
            return self._executor.submit(self._stage, state_dict)
        return self._stage(state_dict)

    def _stage(self, state_dict: STATE_DICT) -> STATE_DICT:
        found: List[torch.Tensor] = []
        _tensor_slots(state_dict, found)
        tensors = list({id(t): t for t in found}.values())  # a shared tensor is staged once
        copies: Dict[int, torch.Tensor] = {}
        on_gpu = any(t.device.type == "cuda" for t in tensors)
        # pinned memory and non-blocking copies only where a tensor is on the GPU: pinning
        # starts a CUDA context, seconds for a process that never uses the GPU
        pin = self._config.use_pinned_memory and on_gpu
        non_blocking = self._config.use_non_blocking_copy and on_gpu
        if self._config.use_shared_memory:
            offsets, total = [], 0
            for t in tensors:
                offsets.append(total)
                total += _aligned(t.numel() * t.element_size())
            if self._segment is None or self._segment.nbytes < total:
                if self._segment is not None:
                    self._segment.close()
                self._segment = None
                self._segment = SharedSegment.create(total, pin=pin)
            elif pin:
                self._segment.pin()
            for t, off in zip(tensors, offsets):
                if t.numel() == 0:  # a view would pickle the whole segment
                    copies[id(t)] = torch.empty(t.shape, dtype=t.dtype)
                    continue
                dst = self._segment.view(off, tuple(t.shape), t.dtype)
                dst.copy_(t.detach(), non_blocking=non_blocking)
                copies[id(t)] = dst
        else:
            for t in tensors:
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                dst.copy_(t.detach(), non_blocking=non_blocking)
                copies[id(t)] = dst
        if non_blocking:
            torch.cuda.synchronize()
        return _rebuild(state_dict, copies)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def __enter__(self) -> "DefaultStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rebuild(value: Any, copies: Dict[int, torch.Tensor]) -> Any:
    """``value`` with tensors replaced by their staged copies and other leaves deep-copied."""
    if isinstance(value, dict):
        return type(value)((k, _rebuild(v, copies)) for k, v in value.items())
    if isinstance(value, list):
        return [_rebuild(v, copies) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_rebuild(v, copies) for v in value)
    if isinstance(value, ShardedTensor):
        if value.data is None or id(value.data) not in copies:
            return value.without_data()
        return replace(value, data=copies[id(value.data)])
    if isinstance(value, ShardedTensorFactory):
        return replace(value, data=copies[id(value.data)])
    if isinstance(value, torch.Tensor):
        return copies[id(value)]
    return copy.deepcopy(value)


class _StagedPickler(pickle.Pickler):
    segments: Dict[str, SharedSegment]

    def persistent_id(self, obj: Any):
        if not (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.numel()
                and obj.is_contiguous()):
            return None
        ptr = obj.data_ptr()
        for seg in list(_LIVE_SEGMENTS.values()):
            lo = seg.base.data_ptr() if seg.base is not None else -1
            if lo <= ptr < lo + seg.nbytes:
                self.segments[seg.path] = seg
                return ("shm", seg.path, seg.nbytes, ptr - lo, tuple(obj.shape), str(obj.dtype))
        return None


class _StagedUnpickler(pickle.Unpickler):
    def __init__(self, file, attach: Callable[[str, int], SharedSegment]):
        super().__init__(file)
        self.attach = attach

    def persistent_load(self, pid):
        _, path, nbytes, offset, shape, dtype = pid
        return self.attach(path, nbytes).view(offset, shape, getattr(torch, dtype.split(".")[-1]))


def dumps_staged(staged: Any, pickler_cls: Optional[type] = None) -> Tuple[bytes, List[SharedSegment]]:
    """A pickle of ``staged`` in which tensors inside live staging segments of this process
    are references, and the segments it refers to. ``pickler_cls``: a subclass of the staged
    pickler (e.g. one that also sends other tensors the ``torch.multiprocessing`` way)."""
    buf = io.BytesIO()
    pickler = (pickler_cls or _StagedPickler)(buf, pickle.HIGHEST_PROTOCOL)
    pickler.segments = {}
    pickler.dump(staged)
    return buf.getvalue(), list(pickler.segments.values())


def loads_staged(payload: bytes, attach: Callable[[str, int], SharedSegment]) -> STATE_DICT:
    """Inverse of :func:`dumps_staged` in the checkpoint process; ``attach(path, nbytes)``
    maps a segment (it must keep a mapping across calls: the creator may unlink the file once
    it was attached). Only for payloads from our own training process over its private pipe."""
    return _StagedUnpickler(io.BytesIO(payload), attach).load()
