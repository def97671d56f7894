"""The allowlisting unpickler: load checkpoint pickles without running code from them.

Checkpoints are pickles, and a plain ``pickle.load``/``torch.load(weights_only=False)`` of an
untrusted one runs whatever the file asks for. Everything in ckpt_tool unpickles through
:class:`SafeUnpickler` instead:

* globals on the allowlist (containers, ``argparse.Namespace``, numpy scalars/arrays/dtypes,
  ``pathlib`` paths, torch tensor rebuild functions, dtypes, ``torch.Size``, DCP metadata
  classes, ...) are imported normally;
* ``megatron.*`` globals become inert :class:`StandIn` classes that keep the pickled fields and
  show the original qualified name, so megatron is never imported;
* anything else raises :class:`~ckpt_tool.errors.UnsafePickleError` naming the global.

``trust=True`` turns the allowlist off (a full, unrestricted unpickle). A stand-in pickles
back as what it stands for (:func:`pickle_module_for`: the original global, the arguments it
was called with, its state), so a common state read this way can be written again (``args``
of Megatron-LM 0.16 holds megatron enums) without megatron imported.

This module does not import torch; :func:`load_torch_file` imports it when called.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import copyreg
import importlib
import io
import os
import pickle
import sys
import types
from pathlib import Path
from typing import IO, Any, Callable

from ckpt_tool.errors import CorruptCheckpointError, UnsafePickleError

__all__ = [
    "ALLOWED_GLOBALS",
    "StandIn",
    "stand_in_class",
    "SafeUnpickler",
    "safe_loads",
    "safe_load",
    "safe_pickle_module",
    "load_torch_file",
    "TRUST_HINT",
    "pickle_module_for",
]

TRUST_HINT = "pass --trust to unpickle it anyway, only if you trust where the checkpoint comes from"

# Harmless globals: "module": {names}. Constructors of plain data, never I/O or code execution.
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    mod: frozenset(names)
    for mod, names in {
        "builtins": {"set", "frozenset", "slice", "range", "complex", "bytearray", "bytes",
                     "list", "dict", "tuple", "int", "float", "bool", "str", "object"},
        "copyreg": {"_reconstructor"},
        "_codecs": {"encode"},
        "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
        "argparse": {"Namespace"},
        "signal": {"Signals"},  # Megatron-LM's args.exit_signal (signal.SIGTERM by default)
        "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
        "decimal": {"Decimal"},
        "fractions": {"Fraction"},
        "uuid": {"UUID"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
        "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath",
                           "Path"},
        "numpy": {"dtype", "ndarray", "bool_", "float64", "float32", "float16", "int64",
                  "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64"},
        "numpy.core.multiarray": {"scalar", "_reconstruct"},
        "numpy._core.multiarray": {"scalar", "_reconstruct"},
        "numpy.dtypes": {"Float64DType", "Float32DType", "Float16DType", "Int64DType",
                         "Int32DType", "Int16DType", "Int8DType", "UInt8DType", "UInt16DType",
                         "UInt32DType", "UInt64DType", "BoolDType", "BytesDType", "StrDType"},
        "numpy.random._pickle": {"__randomstate_ctor", "__bit_generator_ctor",
                                 "__generator_ctor"},
        "ml_dtypes": {"bfloat16"},
        "torch": {"Size", "device", "dtype", "layout", "memory_format", "Tensor",
                  "float32", "float", "float64", "double", "float16", "half", "bfloat16",
                  "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
                  "uint16", "uint32", "uint64", "complex64", "complex128", "cfloat", "cdouble",
                  "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                  "strided", "sparse_coo", "contiguous_format", "channels_last",
                  "preserve_format"},
        "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                         "_rebuild_parameter", "_rebuild_parameter_with_state",
                         "_rebuild_device_tensor_from_numpy", "_rebuild_meta_tensor_no_storage",
                         "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_nested_tensor",
                         "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_cpu_tensor"},
        "torch._tensor": {"_rebuild_from_type_v2"},
        "torch.nn.parameter": {"Parameter"},
        "torch.serialization": {"_get_layout"},
        "torch.storage": {"UntypedStorage", "TypedStorage"},
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
            "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.distributed.checkpoint.planner": {
            "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
            "LoadPlan", "ReadItem", "LoadItemType"},
        "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties",
                                                              "MEM_FORMAT_ENCODING"},
        "torch.distributed._shard.metadata": {"ShardMetadata"},
    }.items()
}


def is_allowed(module: str, name: str) -> bool:
    """Whether ``module.name`` is on the allowlist (``megatron.*`` stand-ins are separate)."""
    if name in ALLOWED_GLOBALS.get(module, ()):
        return True
    # Typed storages (``torch FloatStorage``) are rebuilt by torch.load itself.
    return module == "torch" and name.endswith("Storage") and name.isidentifier()


def _is_megatron(module: str) -> bool:
    return module == "megatron" or module.startswith("megatron.")


class StandIn:
    """An inert object standing in for an instance of a class that was not imported.

    It accepts any constructor arguments and pickle state and keeps them: keyword fields and
    dict state become attributes, positional arguments, a state that is not a dict and
    list/dict payloads appended by the unpickler are kept in slots of their own (so a field
    of the real object may have any name, ``_args`` included). ``repr`` shows the original
    qualified name.
    """

    __slots__ = ("__dict__", "__weakref__", "_stand_in_args", "_stand_in_state",
                 "_stand_in_items")
    __stand_in_for__ = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> StandIn:
        obj = object.__new__(cls)
        if args:
            obj._stand_in_args = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            self._stand_in_args = args
        self.__dict__.update(kwargs)

    def _slot(self, name: str, default: Any = None) -> Any:
        try:
            return object.__getattribute__(self, name)
        except AttributeError:
            return default

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif (isinstance(state, tuple) and len(state) == 2
              and all(s is None or isinstance(s, dict) for s in state)):
            for part in state:
                self.__dict__.update(part or {})
        else:
            self._stand_in_state = state

    # Payloads of list/dict subclasses arrive through append/extend/__setitem__.
    def append(self, item: Any) -> None:
        self._list_items().append(item)

    def extend(self, items: Any) -> None:
        self._list_items().extend(items)

    def _list_items(self) -> list:
        items = self._slot("_stand_in_items")
        if not isinstance(items, list):
            items = self._stand_in_items = []
        return items

    def __setitem__(self, key: Any, value: Any) -> None:
        items = self._slot("_stand_in_items")
        if items is None:
            items = self._stand_in_items = {}
        if isinstance(items, dict):
            items[key] = value

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self.__stand_in_for__} stand-in has no field {name!r}")

    def fields(self) -> dict[str, Any]:
        """The kept fields (constructor keywords and pickle state; for display, the
        positional arguments as ``_args``, a non-dict state as ``_state``, payloads as
        ``_items``, unless a field of the object has that name)."""
        shown = {name: value for name, value in (
            ("_args", self._slot("_stand_in_args")), ("_state", self._slot("_stand_in_state")),
            ("_items", self._slot("_stand_in_items"))) if value is not None}
        return {**shown, **self.__dict__}

    def __reduce_ex__(self, protocol: int) -> tuple:
        """What pickles it back as the object it stands for (with :class:`StandInPickler`):
        called with its arguments (``REDUCE``: an enum member ``AttnBackend(5)``), else
        created empty (``NEWOBJ``); then its state and list/dict items."""
        fields = dict(self.__dict__)
        args = self._slot("_stand_in_args", ())
        items = self._slot("_stand_in_items")
        raw = self._slot("_stand_in_state", _UNSET)
        state = raw if raw is not _UNSET else (fields or None)
        lists = iter(items) if isinstance(items, list) else None
        pairs = iter(items.items()) if isinstance(items, dict) else None
        if args:
            return type(self), tuple(args), state, lists, pairs
        return copyreg.__newobj__, (type(self),), state, lists, pairs

    def __repr__(self) -> str:
        parts = [repr(a) for a in self._slot("_stand_in_args", ())]
        parts += [f"{k}={v!r}" for k, v in self.__dict__.items()]
        return f"{self.__stand_in_for__}({', '.join(parts)})"


_UNSET = object()
_STAND_INS: dict[str, type] = {}


class StandInPickler(pickle._Pickler):  # type: ignore[name-defined]
    """A pickler that writes a stand-in class as the global it stands for (Python's own
    checks the global by importing it)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        qual = getattr(obj, "__stand_in_for__", "?") if isinstance(obj, type) else "?"
        if qual == "?":
            super().save_global(obj, name)
            return
        module, _, attr = qual.rpartition(".")
        if self.proto >= 4:
            self.save(module)
            self.save(attr)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{attr}\n".encode("utf-8"))
        self.memoize(obj)


def _holds_stand_in(obj: Any, seen: set[int], depth: int = 0) -> bool:
    if isinstance(obj, StandIn):
        return True
    if depth > 64 or id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, dict):
        return any(_holds_stand_in(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(_holds_stand_in(v, seen, depth + 1) for v in obj)
    fields = getattr(obj, "__dict__", None)  # argparse.Namespace, dataclasses
    return isinstance(fields, dict) and _holds_stand_in(fields, seen, depth + 1)


_STAND_IN_PICKLE = types.ModuleType("ckpt_tool_stand_in_pickle")
_STAND_IN_PICKLE.Pickler = StandInPickler  # type: ignore[attr-defined]


def pickle_module_for(obj: Any) -> Any:
    """The ``pickle_module`` for ``torch.save(obj)``: ``pickle`` itself, or for an object
    holding stand-ins one whose pickler writes them as what they stand for."""
    return _STAND_IN_PICKLE if _holds_stand_in(obj, set()) else pickle


def stand_in_class(module: str, name: str, base: type = StandIn) -> type:
    """The (cached) :class:`StandIn` subclass for the global ``module.name``."""
    qual = f"{module}.{name}"
    cls = _STAND_INS.get(qual)
    if cls is None:
        cls = type(name, (base,), {"__stand_in_for__": qual, "__module__": __name__,
                                   "__qualname__": f"StandIn[{qual}]"})
        _STAND_INS[qual] = cls
    return cls


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` enforces the allowlist.

    ``overrides`` maps ``"module.name"`` to an object returned instead of importing it (used to
    put stand-ins in place of MCore classes); ``fallback(module, name)`` may return a
    replacement (or ``None`` to go on with the allowlist). ``trust=True`` imports everything
    else.
    """

    def __init__(self, file: IO[bytes], *, trust: bool = False,
                 overrides: dict[str, Any] | None = None,
                 fallback: Callable[[str, str], Any] | None = None,
                 persistent_load: Callable[[Any], Any] | None = None, **kwargs: Any):
        super().__init__(file, **kwargs)
        if persistent_load is not None:
            self.persistent_load = persistent_load
        self._trust = trust
        self._overrides = overrides or {}
        self._fallback = fallback

    def load(self) -> Any:
        """The unpickled object, checked to be a tree no deeper than :data:`MAX_NESTING`."""
        obj = super().load()
        check_nesting(obj)
        return obj

    def find_class(self, module: str, name: str) -> Any:
        # Protocol <= 2 pickles name Python 2 modules (``__builtin__``, ``commands``): check and
        # report the Python 3 global the default unpickler would import.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        qual = f"{module}.{name}"
        if qual in self._overrides:
            return self._overrides[qual]
        if self._fallback is not None:
            found = self._fallback(module, name)
            if found is not None:
                return found
        if self._trust:
            return super().find_class(module, name)
        if is_allowed(module, name):
            found = _import_global(module, name)
            return _capped(qual, found) if qual in _SIZED else found
        added = _torch_safe_global(module, name)
        if added is not None:
            return added
        if _is_megatron(module):
            return stand_in_class(module, name)
        raise UnsafePickleError(
            f"the pickle references {qual}, which is not on the allowlist of safe globals",
            hint=TRUST_HINT,
        )


#: How deep an unpickled state may nest containers (a checkpoint's states nest a few tens of
#: levels; every walk over them, the summaries of inspect, the comparisons of diff, the
#: pickling of a target, recurses).
MAX_NESTING = 1000


def _children(obj: Any) -> Any:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    d = getattr(obj, "__dict__", None) if isinstance(obj, (StandIn, argparse.Namespace)) \
        else None
    return None if d is None else list(d.values())


def check_nesting(obj: Any) -> None:
    """CorruptCheckpointError when ``obj`` nests containers deeper than :data:`MAX_NESTING`
    or holds a container that contains itself: no checkpoint's state is built so, and the
    walks over it would end in a RecursionError (iterative: any depth is checked)."""
    stack: list[tuple[Any, int, bool]] = [(obj, 0, False)]
    on_path: set[int] = set()
    done: set[int] = set()
    while stack:
        o, depth, leaving = stack.pop()
        if leaving:
            on_path.discard(id(o))
            done.add(id(o))
            continue
        children = _children(o)
        if not children:
            continue
        if id(o) in on_path:
            raise CorruptCheckpointError(
                f"the pickled state holds a {type(o).__name__} that contains itself (a cycle)",
                hint="no checkpoint's state is built so: the file is damaged or crafted")
        if id(o) in done:
            continue
        if depth >= MAX_NESTING:
            raise CorruptCheckpointError(
                f"the pickled state nests containers more than {MAX_NESTING} levels deep",
                hint="no checkpoint's state is built so: the file is damaged or crafted")
        on_path.add(id(o))
        stack.append((o, depth, True))
        stack.extend((c, depth + 1, False) for c in children)


#: The most one call to an allowlisted constructor may allocate while unpickling
#: (``bytearray(2_000_000_000)`` is a 120-byte pickle): a checkpoint's pickles carry their
#: data in their own bytes, never as a size to allocate. ``--trust`` lifts the cap.
MAX_ALLOCATION = 256 << 20
# constructors that allocate what an argument says (an int: a size; a range: its length) and
# that pickles only ever call (never pass on as a type, as numpy's and torch's rebuilders
# take ``numpy.ndarray``, ``torch.Tensor`` and storage classes)
_SIZED = frozenset({"builtins.bytearray", "builtins.bytes", "builtins.list", "builtins.tuple",
                    "builtins.set", "builtins.frozenset", "builtins.dict",
                    "collections.Counter", "collections.OrderedDict"})


def _requested(args: tuple, kwargs: dict) -> int:
    """About the bytes a constructor call with ``args`` allocates from sizes alone."""
    total = 0
    for a in (*args, *kwargs.values()):
        if type(a) is int:
            total += max(a, 0)
        elif isinstance(a, range):
            total += 8 * len(a)  # (a pointer per element, at least)
    return total


def _capped(qual: str, ctor: Any) -> Any:
    """``ctor`` refusing (CorruptCheckpointError) a call that would allocate more than
    :data:`MAX_ALLOCATION` from its arguments' sizes."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            need = _requested(args, kwargs)
        except (OverflowError, TypeError, ValueError):
            need = MAX_ALLOCATION + 1
        if need > MAX_ALLOCATION:
            raise CorruptCheckpointError(
                f"the pickle asks {qual} for about {need:,} bytes, over the "
                f"{MAX_ALLOCATION >> 20} MiB one unpickled constructor call may allocate",
                hint="a checkpoint carries its data in its bytes, not as sizes to allocate; "
                     "--trust unpickles without the cap (only for files you trust)")
        return ctor(*args, **kwargs)
    call.__name__ = call.__qualname__ = getattr(ctor, "__name__", "capped")
    return call


def _torch_safe_global(module: str, name: str) -> Any:
    """The switch beside the allowlist: a global the process added with
    ``torch.serialization.add_safe_globals`` (torch's own ``weights_only`` switch, e.g.
    ``add_safe_globals([io.BytesIO])`` for ShardedObjects holding BytesIO) is allowed too."""
    serialization = sys.modules.get("torch.serialization")
    if serialization is None or not hasattr(serialization, "get_safe_globals"):
        return None
    for entry in serialization.get_safe_globals():
        obj, qual = entry if isinstance(entry, tuple) else (
            entry, f"{getattr(entry, '__module__', '')}.{getattr(entry, '__qualname__', '')}")
        if qual == f"{module}.{name}":
            return obj
    return None


def _import_global(module: str, name: str) -> Any:
    mod = sys.modules.get(module) or importlib.import_module(module)
    obj = mod
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _reraise(exc: BaseException, where: str | os.PathLike | None) -> None:
    """Turn what a garbage pickle raises into CorruptCheckpointError (keeps our own errors)."""
    if isinstance(exc, (UnsafePickleError, CorruptCheckpointError)):
        if exc.path is None and where is not None:
            exc.path = str(where)
        raise exc
    detail = (str(exc).strip().splitlines() or [""])[0]
    detail = detail.split(". ")[0][:160] if detail else "empty input"
    raise CorruptCheckpointError(
        f"cannot unpickle ({type(exc).__name__}: {detail}); the file is truncated or not a "
        "valid pickle", path=where,
    ) from None


def safe_loads(data: bytes, *, trust: bool = False, where: str | os.PathLike | None = None,
               **kwargs: Any) -> Any:
    """Unpickle ``data`` through :class:`SafeUnpickler` (kwargs go to it)."""
    return safe_load(io.BytesIO(data), trust=trust, where=where, **kwargs)


def safe_load(file: IO[bytes], *, trust: bool = False, where: str | os.PathLike | None = None,
              **kwargs: Any) -> Any:
    """Unpickle one object from ``file``; a truncated or garbage pickle raises
    CorruptCheckpointError, a forbidden global UnsafePickleError."""
    try:
        return SafeUnpickler(file, trust=trust, **kwargs).load()
    except Exception as exc:  # noqa: BLE001 - garbage input can raise anything
        _reraise(exc, where)


def safe_pickle_module(*, trust: bool = False) -> types.ModuleType:
    """A module object usable as ``torch.load(pickle_module=...)`` that unpickles safely."""
    mod = types.ModuleType("ckpt_tool_safe_pickle")

    class Unpickler(SafeUnpickler):
        def __init__(self, file: IO[bytes], **kwargs: Any):
            super().__init__(file, trust=trust, **kwargs)

    def load(file: IO[bytes], **kwargs: Any) -> Any:
        return Unpickler(file, **kwargs).load()

    def loads(data: bytes, **kwargs: Any) -> Any:
        return load(io.BytesIO(data), **kwargs)

    mod.Unpickler = Unpickler  # type: ignore[attr-defined]
    mod.load = load  # type: ignore[attr-defined]
    mod.loads = loads  # type: ignore[attr-defined]
    mod.__dict__.update({k: getattr(pickle, k) for k in ("HIGHEST_PROTOCOL", "UnpicklingError")})
    return mod


def load_torch_file(path_or_fileobj: str | os.PathLike | IO[bytes], *, trust: bool = False,
                    map_location: Any = "cpu", verify: bool = True) -> Any:
    """``torch.load`` a file (path or binary file object) through the allowlisting unpickler.

    Loads Megatron-LM's ``common.pt`` (``argparse.Namespace`` args, numpy values, torch dtypes,
    ``PosixPath``, megatron enums/dataclasses as :class:`StandIn`) without importing megatron.
    A global outside the allowlist raises UnsafePickleError; a damaged file
    CorruptCheckpointError. ``trust=True`` does an unrestricted ``torch.load``. ``verify``:
    a zip archive (a path, or an ``io.BytesIO``) has the CRC-32 of every record checked first
    (``archive_check``; IntegrityError) -- ``torch.load`` itself does not check them.
    """
    import torch

    from ckpt_tool.storage import as_path, is_remote

    where = path_or_fileobj if isinstance(path_or_fileobj, (str, os.PathLike)) \
        or is_remote(path_or_fileobj) else None
    if where is not None and not as_path(where).is_file():
        from ckpt_tool.errors import InputError

        raise InputError("no such file", path=where, hint="check the path")
    if where is not None and not is_remote(where):
        from ckpt_tool.formats.containers.torch_zip.tar_form import refuse_tar_form

        refuse_tar_form(where)
    if verify:
        _check_zip(path_or_fileobj, where)
    if where is not None and is_remote(where):
        path_or_fileobj = as_path(where).open("rb")
    try:
        return torch.load(path_or_fileobj, map_location=map_location, weights_only=False,
                          pickle_module=safe_pickle_module(trust=trust))
    except (UnsafePickleError, CorruptCheckpointError) as exc:
        _reraise(exc, where)
    except Exception as exc:  # noqa: BLE001
        _reraise(exc, where)


_ZIP_MAGIC = b"PK\x03\x04"  # what torch.load takes for a zip archive (else a legacy pickle)


def _check_zip(source: Any, where: Any) -> None:
    """The CRC-32 check of ``load_torch_file(verify=True)``."""
    from ckpt_tool.formats.containers.torch_zip.archive_check import check_archive, check_file
    from ckpt_tool.storage import as_path, read_range

    if where is not None:
        if read_range(as_path(where), 0, 4) == _ZIP_MAGIC:
            check_file(where)
    elif isinstance(source, io.BytesIO):
        with source.getbuffer() as view:
            if bytes(view[:4]) == _ZIP_MAGIC:
                check_archive(view, "torch.save archive")
