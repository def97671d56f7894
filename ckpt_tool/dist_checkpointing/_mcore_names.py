"""Helpers that Megatron-Core's ``dist_checkpointing`` modules re-export from ``megatron.core``.

Megatron-LM's code and tests reach some names through the dist_checkpointing modules although
they live elsewhere in Megatron-Core (``MultiStorageClientFeature`` from ``msc_utils``,
``log_single_rank``, ``get_pg_rank``/``get_pg_size``, ``to_local_if_dtensor``, the torch
version helpers). Ours are written here, without importing megatron-core, and re-exported by
the modules that re-export them in 0.16.1 (``tests/interop/test_api_signatures.py`` checks the
list).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

__all__ = ["MultiStorageClientFeature", "MSC_PREFIX", "log_single_rank", "get_pg_rank",
           "get_pg_size", "to_local_if_dtensor", "get_torch_version", "is_torch_min_version",
           "HAVE_DTENSOR", "HAVE_TE", "HAVE_TE_FLOAT8TENSOR", "HAVE_PSUTIL"]

MSC_PREFIX = "msc://"

try:
    from torch.distributed._tensor import DTensor

    HAVE_DTENSOR = True
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = None
    HAVE_DTENSOR = False

try:
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except Exception:  # noqa: BLE001 (TE fails to import in many ways without a GPU)
    HAVE_TE = False

try:
    from transformer_engine.pytorch.float8_tensor import Float8Tensor  # noqa: F401

    HAVE_TE_FLOAT8TENSOR = True
except Exception:  # noqa: BLE001
    HAVE_TE_FLOAT8TENSOR = False

try:
    import psutil  # noqa: F401

    HAVE_PSUTIL = True
except ImportError:
    HAVE_PSUTIL = False


class _MultiStorageClientFlag:
    """The multi-storage-client switch. ``save``/``load`` and the other functions of
    ``ckpt_tool.dist_checkpointing`` take ``msc://profile/path`` (and ``s3://``) paths
    themselves (``ckpt_tool.storage``: the profile is read from multi-storage-client's own
    configuration file), so the switch that makes Megatron-Core route file calls through the
    ``multistorageclient`` package stays off: :meth:`is_enabled` is ``False``, and
    :meth:`import_package` says to pass the URL instead (``enable`` is accepted and has no
    effect, so code that enables it keeps working)."""

    def __init__(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        """Ask for MSC; it stays off here (see the class docstring)."""
        self._enabled = True

    def disable(self) -> None:
        """Turn MSC off (it is always off)."""
        self._enabled = False

    def is_enabled(self) -> bool:
        """Always ``False``: msc:// paths are read and written without the package."""
        return False

    def import_package(self) -> Any:
        """Raises: the ``multistorageclient`` API is not provided (pass msc:// paths)."""
        raise RuntimeError("ckpt_tool.dist_checkpointing does not hand out the "
                           "multistorageclient package: pass the msc:// (or s3://) path to "
                           "save/load, which read and write object stores themselves")


MultiStorageClientFeature = _MultiStorageClientFlag()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_single_rank(logger: logging.Logger, *args: Any, rank: int = 0, **kwargs: Any) -> None:
    """``logger.log(*args, **kwargs)`` on global rank ``rank`` only (every rank without a
    process group)."""
    if _rank() == rank:
        logger.log(*args, **kwargs)


def get_pg_size(group: Optional[torch.distributed.ProcessGroup] = None) -> int:
    """Size of ``group``; 1 without a process group or with ``group`` None."""
    if not torch.distributed.is_initialized() or group is None:
        return 1
    return group.size()


def get_pg_rank(group: Optional[torch.distributed.ProcessGroup] = None) -> int:
    """This process's rank in ``group``; 0 without a process group or with ``group`` None."""
    if not torch.distributed.is_initialized() or group is None:
        return 0
    return group.rank()


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, any other tensor as it is."""
    with torch.no_grad():
        if HAVE_DTENSOR and isinstance(tensor, DTensor):
            return tensor.to_local()
        return tensor


def get_torch_version():
    """The installed torch version as a ``packaging`` Version."""
    from packaging.version import Version

    return Version(torch.__version__.split("+")[0])


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether torch is at least ``version`` (strictly newer with ``check_equality=False``)."""
    from packaging.version import Version

    if check_equality:
        return get_torch_version() >= Version(version)
    return get_torch_version() > Version(version)
