"""Torch-free stand-ins for the torch globals that checkpoint pickles reference.

The metadata path (``ckpt inspect``) unpickles DCP ``.metadata`` files and the ``data.pkl`` of
``torch.save`` archives without importing torch: :func:`torch_free_fallback` is a
``SafeUnpickler`` fallback that answers ``torch.*`` globals with the stand-ins below
(dtype names, a tuple for ``torch.Size``, attribute bags for the DCP dataclasses, placeholders
for tensors). A torch global it does not know raises :class:`NeedsTorch`, so the caller can
retry through the real torch classes.
"""

from __future__ import annotations

import math
from typing import Any

from ckpt_tool.formats.containers.pickle.safe_pickle import StandIn, stand_in_class

__all__ = ["NeedsTorch", "DtypeName", "TorchSize", "TensorPlaceholder", "StoragePlaceholder",
           "TensorPropertiesStub", "MetadataIndexStub", "torch_free_fallback", "dtype_name"]

_DTYPE_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
}
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128", "UntypedStorage": "uint8",
}
_DTYPE_NAMES = {
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", *_DTYPE_ALIASES,
}


class NeedsTorch(Exception):
    """The pickle references a torch global that only real torch can rebuild."""


class DtypeName(str):
    """A torch dtype seen without torch: its name without ``torch.`` (``"bfloat16"``)."""

    def __repr__(self) -> str:
        return f"torch.{self}"


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or a DtypeName -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class TorchSize(tuple):
    """``torch.Size`` without torch."""

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class StoragePlaceholder:
    """A storage of a torch.save archive that was not read: dtype, element count, record key."""

    def __init__(self, dtype: str, numel: int, key: str):
        self.dtype, self.numel, self.key = dtype, numel, key

    def __repr__(self) -> str:
        return f"<storage {self.dtype} x{self.numel} at data/{self.key}>"


class TensorPlaceholder:
    """A tensor of a torch.save archive, described but not read (``storage_offset`` in
    elements, ``stride`` as pickled; ``None`` when unknown)."""

    def __init__(self, dtype: str, shape: tuple[int, ...], storage: StoragePlaceholder | None,
                 storage_offset: int = 0, stride: tuple[int, ...] | None = None):
        self.dtype, self.shape, self.storage = dtype, tuple(shape), storage
        self.storage_offset = int(storage_offset)
        self.stride = None if stride is None else tuple(int(s) for s in stride)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"<tensor {self.dtype} {list(self.shape)}>"


def _rebuild_tensor(storage: Any, storage_offset: int = 0, size: Any = (), stride: Any = None,
                    *rest: Any) -> TensorPlaceholder:
    dtype = storage.dtype if isinstance(storage, StoragePlaceholder) else "unknown"
    return TensorPlaceholder(dtype, tuple(size), storage if isinstance(storage,
                                                                        StoragePlaceholder) else None,
                             storage_offset, stride)


def _rebuild_tensor_v3(storage: Any, storage_offset: int, size: Any, stride: Any,
                       requires_grad: Any = False, backward_hooks: Any = None,
                       dtype: Any = None, *rest: Any) -> TensorPlaceholder:
    """v3 (untyped storage + explicit dtype: uint16, float8, ...)."""
    t = _rebuild_tensor(storage, storage_offset, size, stride)
    if dtype is not None:
        t.dtype = dtype_name(dtype)
    return t


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor pickled with Python attributes (e.g. Megatron's fp32 main params): the plain
    tensor placeholder; the attributes are dropped."""
    return func(*args)


class TensorPropertiesStub(StandIn):
    """DCP ``TensorProperties``: pickled as a tuple state ``(dtype, layout, requires_grad, ...)``."""

    __stand_in_for__ = "torch.distributed.checkpoint.metadata.TensorProperties"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            names = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
            self.__dict__.update(zip(names, state))
        else:
            super().__setstate__(state)


class MetadataIndexStub(StandIn):
    """DCP ``MetadataIndex`` (a dict key in ``storage_data``): hashable on (fqn, offset)."""

    __stand_in_for__ = "torch.distributed.checkpoint.metadata.MetadataIndex"

    def _ident(self) -> tuple[Any, ...]:
        d = self.__dict__
        off = d.get("offset")
        return (d.get("fqn"), None if off is None else tuple(off))

    def __hash__(self) -> int:
        return hash(self._ident())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndexStub) and self._ident() == other._ident()


def _storage_info_class() -> type:
    cls = stand_in_class("torch.distributed.checkpoint.filesystem", "_StorageInfo")
    cls.transform_descriptors = None  # omitted from the pickle when None
    return cls


_DCP_MODULES = {
    "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed._shard.sharded_tensor.metadata", "torch.distributed._shard.metadata",
}
_SPECIAL: dict[str, Any] = {}


def _special(qual: str) -> Any:
    if not _SPECIAL:
        _SPECIAL.update({
            "torch.Size": TorchSize,
            "torch.serialization._get_layout": lambda name: str(name),
            "torch.device": lambda *a: "device(" + ", ".join(map(repr, a)) + ")",
            "torch._utils._rebuild_tensor": _rebuild_tensor,
            "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
            "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
            "torch.storage.UntypedStorage": DtypeName("uint8"),
            "torch._utils._rebuild_parameter": _rebuild_parameter,
            "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
            "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
            "torch.Tensor": "torch.Tensor",
            "torch.distributed.checkpoint.metadata.TensorProperties": TensorPropertiesStub,
            "torch.distributed._shard.sharded_tensor.metadata.TensorProperties":
                TensorPropertiesStub,
            "torch.distributed.checkpoint.metadata.MetadataIndex": MetadataIndexStub,
            "torch.distributed.checkpoint.filesystem._StorageInfo": _storage_info_class(),
        })
    return _SPECIAL.get(qual)


def torch_free_fallback(module: str, name: str) -> Any:
    """SafeUnpickler fallback answering ``torch.*`` globals without importing torch.

    Returns ``None`` for non-torch globals (the allowlist decides), a stand-in for known
    torch globals, and raises :class:`NeedsTorch` for other allowlisted torch globals. Globals
    outside the allowlist still fail in the unpickler (never silently stubbed).
    """
    if module != "torch" and not module.startswith("torch."):
        return None
    qual = f"{module}.{name}"
    special = _special(qual)
    if special is not None:
        return special
    if module == "torch" and name in _DTYPE_NAMES:
        return DtypeName(_DTYPE_ALIASES.get(name, name))
    if module == "torch" and name in ("strided", "sparse_coo", "contiguous_format",
                                      "channels_last", "preserve_format"):
        return f"torch.{name}"
    if module == "torch" and name in _STORAGE_DTYPES:
        return DtypeName(_STORAGE_DTYPES[name])
    from ckpt_tool.formats.containers.pickle.safe_pickle import is_allowed

    if module in _DCP_MODULES and is_allowed(module, name):
        return stand_in_class(module, name)
    if is_allowed(module, name):
        raise NeedsTorch(qual)
    return None
