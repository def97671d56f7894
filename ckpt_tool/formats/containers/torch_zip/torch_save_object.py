"""``torch.save`` of a plain object (a checkpoint's common state) without torch, byte for byte.

``ckpt reshard`` changes ``args`` of the common state (``common.pt``) and saves it again. Doing
that with ``torch.save`` needs torch imported (seconds of CPU) for a file of a few KB. Here:

* :func:`load_exact` unpickles a ``common.pt`` through the allowlisting unpickler with every
  torch dtype it references as a :class:`TorchRef` (one object per name, as torch's dtypes
  are singletons) instead of the real dtype; anything else of torch (tensors, storages, sizes,
  devices, dtype aliases) makes it give up (``None``): the caller loads it with torch;
* :func:`torch_free_pickle` is the ``data.pkl`` ``torch.save`` writes for an object (its pickler
  is Python's C pickler, protocol 2, and for an object without tensors or storages its
  ``persistent_id`` adds nothing) when every value in it is of a type on a short allowlist
  whose pickle is the same whichever way the object was loaded (built-in scalars and
  containers, ``argparse.Namespace``, ``pathlib`` paths, numpy scalars and dtypes, torch dtypes
  real or :class:`TorchRef`); ``None`` otherwise. A :class:`TorchRef` is pickled as a reference
  to a name of this module, and that ``GLOBAL`` opcode is rewritten to name ``torch``
  (protocol 2 has no frames nor lengths around it, memo indices stay as they are);
* :func:`save_object` writes the file: the archive from
  :func:`ckpt_tool.formats.containers.torch_zip.torch_zip_write.object_archive`, else ``torch.save``.

``tests/formats/test_torch_save_object.py`` compares the bytes with ``torch.save``'s.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import pickletools
import sys
import zipfile
from typing import Any

__all__ = ["TorchRef", "load_exact", "torch_free_pickle", "object_archive_of", "object_item",
           "save_object", "archive_prefix"]

#: torch dtypes by the name they pickle as (``torch.float`` pickles as ``float32``: an alias
#: in a pickle would come back under its canonical name, so it is not taken)
DTYPE_NAMES = frozenset({
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "uint16", "uint32", "uint64", "bool", "complex64", "complex128", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


class TorchRef:
    """A torch dtype without torch: ``TorchRef.of("bfloat16")`` is one object per name; it
    prints as torch's does (``torch.bfloat16``) and pickles as ``torch.bfloat16``."""

    __slots__ = ("name",)
    _all: dict[str, "TorchRef"] = {}

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def of(cls, name: str) -> "TorchRef":
        if name not in DTYPE_NAMES:
            raise ValueError(f"torch.{name} is not a dtype")
        return cls._all.setdefault(name, cls(name))

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def __reduce__(self) -> str:
        # only :func:`torch_free_pickle` may pickle it (as torch's dtype): anything else
        # (torch.save among them) would write a reference to this module
        raise pickle.PicklingError(f"{self!r} stands in for torch's dtype: load the object "
                                   "with torch to pickle it any other way")


_REF_PREFIX = "_torch_dtype_"
_MODULE_REF = f"{__name__} {_REF_PREFIX}"


def __getattr__(name: str) -> Any:  # the pickler checks each reference by looking it up
    if name.startswith(_REF_PREFIX) and name[len(_REF_PREFIX):] in TorchRef._all:
        return TorchRef._all[name[len(_REF_PREFIX):]]
    raise AttributeError(name)


class _Pickler(pickle.Pickler):
    """Python's C pickler; a :class:`TorchRef` becomes a reference to a name of this module
    (rewritten to ``torch`` afterwards)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is TorchRef:
            return _REF_PREFIX + obj.name  # see __getattr__ above
        return NotImplemented


class _Give(BaseException):
    """Raised inside the unpickler: this pickle needs torch."""


def _fallback(module: str, name: str) -> Any:
    if module == "torch" and name in DTYPE_NAMES:
        return TorchRef.of(name)
    if module == "torch" or module.startswith("torch."):
        raise _Give
    return None


def _no_persistent(pid: Any) -> Any:
    raise _Give  # a tensor or storage


def load_exact(source: str | os.PathLike | bytes, *, trust: bool = False) -> Any:
    """The object the ``torch.save`` file ``source`` (a path or the archive's bytes) holds,
    torch dtypes as :class:`TorchRef`; ``None`` when it holds more of torch than dtypes, is
    no zip archive or has no ``data.pkl`` (the caller then loads it with torch, which
    reports what is wrong)."""
    from ckpt_tool.formats.containers.pickle.safe_pickle import SafeUnpickler

    from ckpt_tool.storage import is_remote

    if is_remote(source):
        source = source.open("rb")
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as zf:
            names = zf.namelist()
            pkl = [n for n in names if n.endswith("/data.pkl")]
            if len(pkl) != 1 or any("/data/" in n for n in names):
                return None
            data = zf.read(pkl[0])
    except (zipfile.BadZipFile, OSError, EOFError):
        return None
    try:
        return SafeUnpickler(io.BytesIO(data), trust=trust, fallback=_fallback,
                             persistent_load=_no_persistent, encoding="utf-8").load()
    except _Give:
        return None
    except Exception:  # noqa: BLE001 - torch's loader says what is wrong with it
        return None


def torch_free_pickle(obj: Any) -> bytes | None:
    """``data.pkl`` of ``torch.save(obj)`` when every value in ``obj`` is on the allowlist
    (see the module docstring), else ``None``."""
    if not _plain(obj, set(), 0):
        return None
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    data = buf.getvalue()
    if _MODULE_REF.split(" ")[0].encode() not in data:
        return data
    out, at = bytearray(), 0
    for op, arg, pos in pickletools.genops(data):
        if op.name == "GLOBAL" and str(arg).startswith(_MODULE_REF):
            end = data.index(b"\n", data.index(b"\n", pos + 1) + 1) + 1
            out += data[at:pos] + b"ctorch\n" + str(arg)[len(_MODULE_REF):].encode() + b"\n"
            at = end
    return bytes(out + data[at:])


_SCALARS = (type(None), bool, int, float, str, bytes)
_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath)


def _plain(obj: Any, seen: set[int], depth: int) -> bool:
    t = type(obj)
    if t in _SCALARS or t is TorchRef:
        return True
    if depth > 64:
        return False
    if id(obj) in seen:
        return True
    seen.add(id(obj))
    if t is list or t is tuple:
        return all(_plain(x, seen, depth + 1) for x in obj)
    if t is dict:
        return all(_plain(k, seen, depth + 1) and _plain(v, seen, depth + 1)
                   for k, v in obj.items())
    if t is argparse.Namespace:
        return _plain(vars(obj), seen, depth + 1)
    if t in _PATHS:
        return True
    np = sys.modules.get("numpy")
    if np is not None and (isinstance(obj, np.dtype) or (
            isinstance(obj, np.generic) and t.__module__ == "numpy"
            and not isinstance(obj, (np.object_, np.void)))):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and t is torch.dtype and str(obj) == f"torch.{_dtype_name(obj)}"


def _dtype_name(dtype: Any) -> str:
    name = dtype.__reduce__()
    return name if isinstance(name, str) and name in DTYPE_NAMES else ""


def archive_prefix(path: str | os.PathLike) -> str:
    """The record prefix ``torch.save`` gives the file ``path``: its name up to the last dot
    (``common`` for ``common.pt``); ``archive`` for a name ours opens through a link
    (:func:`ckpt_tool.formats.write_guard.zip_writer_name`: non-ASCII paths)."""
    path = os.fspath(path)
    if not path.isascii():
        return "archive"
    name = os.path.basename(path)
    return name.rsplit(".", 1)[0] if "." in name else name


def object_archive_of(value: Any) -> bytes | None:
    """``torch.save(value)`` into a stream without torch, or ``None`` (see
    :func:`torch_free_pickle`)."""
    from ckpt_tool.formats.containers.torch_zip.torch_zip_write import object_archive

    pkl = torch_free_pickle(value)
    return None if pkl is None else object_archive(pkl, "archive")


def object_item(payload: Any) -> bytes | None:
    """``torch.save([payload])`` into a stream (a ShardedObject's bytes item, as
    Megatron-Core and DCP store it) without torch, or ``None``."""
    return object_archive_of([payload])


def save_object(obj: Any, path: str | os.PathLike) -> bool:
    """Write ``torch.save(obj, path)``'s bytes; True when it was done without torch."""
    from ckpt_tool.formats.containers.torch_zip.torch_zip_write import object_archive

    pkl = torch_free_pickle(obj)
    if pkl is None:
        from ckpt_tool.formats.write_guard import torch_save_file

        torch_save_file(obj, path)
        return False
    data = object_archive(pkl, archive_prefix(path))
    with open(path, "wb") as f:
        f.write(data)
    return True
