"""The request object of an asynchronous save.

NOTE: minimal for now — only the :class:`AsyncRequest` that save strategies return and that
``AsyncSaveShardedStrategy.save`` runs synchronously. The scheduling machinery of
Megatron-Core's module (``AsyncCallsQueue``, persistent worker processes) comes later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["AsyncRequest"]


@dataclass
class AsyncRequest:
    """A save split into a (possibly background) write and finalize steps on every rank.

    Args:
        async_fn: the write function; None when this rank has nothing to write.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: run in order on every rank once all ranks finished writing (they may
            use collectives); the checkpoint is complete only after them.
        preload_fn: optional staging step (e.g. copy to host memory) run before ``async_fn``.
    """

    async_fn: Optional[Callable]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable] = field(default_factory=list)
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable) -> None:
        """Append a finalize function (not allowed once the request is frozen)."""
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        """Mark the request as ready to be scheduled."""
        self.is_frozen = True
        return self

    def execute_sync(self) -> None:
        """Preload, write and finalize in the calling process."""
        if self.preload_fn is not None:
            self.preload_fn()
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args)
        for fn in self.finalize_fns:
            fn()
