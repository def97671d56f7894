"""``torch.save`` of plain values without torch, and DCP's flattening of a state dict.

A plain DCP checkpoint stores each non-tensor value of the state (the common state, each
object) as ``torch.save(value)`` in a bytes item. For a value that holds no tensor that
archive is a protocol 2 pickle of the value in torch's zip layout
(:func:`ckpt_tool.formats.torch_zip_write.pickle_archive`), so a conversion whose source was
read without torch can write it without torch too:

* :func:`load_plain` loads a ``torch.save`` archive (a torch_dist ``common.pt``, an object's
  bytes item) through the allowlisting unpickler, torch dtypes as :class:`TorchDtype`
  stand-ins; any other torch global, or a tensor, raises ``NeedsTorch``;
* :func:`plain_archive` pickles such a value as torch's pickler does (Python's own pickler,
  the stand-ins written as the ``torch.<dtype>`` globals they stand for) and returns the
  archive, byte for byte ``torch.save``'s (``tests/formats/test_dcp_writer_raw.py``), or
  None when the value holds something only torch can pickle;
* :func:`flatten_state` is ``torch.distributed.checkpoint``'s ``flatten_state_dict`` (keys
  joined by dots, the path of each) as DCP's save applies it.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UnsupportedError
from ckpt_tool.formats.torch_stand_ins import NeedsTorch
from ckpt_tool.formats.torch_zip_write import pickle_archive

__all__ = ["TorchDtype", "load_plain", "plain_archive", "flatten_state"]


class TorchDtype:
    """A torch dtype read without torch (one object per name, as torch's are singletons)."""

    _by_name: dict[str, TorchDtype] = {}

    def __new__(cls, name: str) -> TorchDtype:
        if name not in cls._by_name:
            obj = object.__new__(cls)
            obj.name = name
            cls._by_name[name] = obj
        return cls._by_name[name]

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Signal(BaseException):  # through the unpickler's own error handling
    pass


def load_plain(source: bytes | os.PathLike, *, trust: bool = False) -> Any:
    """The value of a ``torch.save`` archive that holds no tensor, torch dtypes as
    :class:`TorchDtype`; raises ``NeedsTorch`` for anything else of torch's."""
    from ckpt_tool.formats.safe_pickle import safe_load
    from ckpt_tool.formats.torch_stand_ins import _DTYPE_ALIASES, _DTYPE_NAMES

    where = None if isinstance(source, (bytes, bytearray)) else Path(source)
    blob: Any = io.BytesIO(source) if where is None else where
    try:
        with zipfile.ZipFile(blob) as zf:
            names = sorted((n for n in zf.namelist() if n.endswith("data.pkl")), key=len)
            if not names:
                raise NeedsTorch("no data.pkl in the archive")
            data = zf.read(names[0])
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise NeedsTorch(f"not a readable torch.save zip archive ({exc})") from None

    def fallback(module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPE_NAMES:
            return TorchDtype(_DTYPE_ALIASES.get(name, name))
        if module == "torch" or module.startswith("torch."):
            raise _Signal(f"{module}.{name}")
        return None

    def persistent_load(pid: Any) -> Any:
        raise _Signal("a tensor")

    try:
        return safe_load(io.BytesIO(data), trust=trust, where=where, fallback=fallback,
                         persistent_load=persistent_load, encoding="utf-8")
    except _Signal as exc:
        raise NeedsTorch(f"the value holds {exc}") from None


class _Pickler(pickle._Pickler):  # the Python pickler: its dispatch table can be extended
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_dtype(self, obj: TorchDtype) -> None:
        self.write(pickle.GLOBAL + b"torch\n" + obj.name.encode() + b"\n")
        self.memoize(obj)

    dispatch[TorchDtype] = _save_dtype


def plain_archive(value: Any) -> bytes | None:
    """``torch.save(value)`` into a stream, byte for byte, for a value without tensors (torch
    dtypes as :class:`TorchDtype`); None when only torch can pickle it."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=2).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError, ImportError, RecursionError):
        return None
    return pickle_archive(buf.getvalue())


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def flatten_state(state: dict) -> tuple[dict[str, Any], dict[str, tuple]]:
    """``({"a.b.0": value}, {"a.b.0": ("a", "b", 0)})`` as DCP's ``flatten_state_dict``:
    mappings are walked (keys as ``str``), a list only when it holds a tensor or a list or
    mapping that is walked, tuples and every other value are leaves; an empty mapping
    leaves nothing. Pure."""
    from collections.abc import Mapping

    flat: dict[str, Any] = {}
    paths: dict[str, tuple] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            return False
        if not isinstance(value, list):
            return True
        return not any((isinstance(v, (Mapping, list)) and not terminal(v)) or _is_tensor(v)
                       for v in value)

    def walk(path: tuple, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif terminal(value):
            fqn = ".".join(map(str, path))
            if fqn in flat:
                raise UnsupportedError(f"the state has two values under the flattened key {fqn} "
                                       "(a nested key and a key with dots), which DCP cannot "
                                       "store apart")
            flat[fqn], paths[fqn] = value, path
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    for key, value in state.items():
        walk((str(key),), value)
    return flat, paths


_MEMO_OPS = {"BINPUT": "PUT", "LONG_BINPUT": "PUT", "BINGET": "GET", "LONG_BINGET": "GET"}


def unwrapped_archive(stored: bytes) -> bytes | None:
    """``torch.save(payload)`` from the bytes of ``torch.save([payload])`` (a Megatron-Core
    ShardedObject's bytes item), tensors included, without torch: the same storage records,
    ``data.pkl`` without the list (its memo indices one lower, as the pickler numbers them
    without it); None when ``stored`` is not such an archive."""
    import pickletools
    import struct

    from ckpt_tool.formats.torch_zip_write import records_archive

    try:
        with zipfile.ZipFile(io.BytesIO(stored)) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            if not names or any(not n.startswith("archive/") for n in names) or \
                    names[0] != "archive/data.pkl" or names[-2:] != [
                        "archive/version", "archive/.data/serialization_id"]:
                return None
            records = [(n.removeprefix("archive/"), zf.read(n)) for n in names[:-2]]
            names_id = zf.read(names[-1]).decode("ascii")[:20]
            ops = list(pickletools.genops(records[0][1]))
    except (zipfile.BadZipFile, OSError, ValueError, UnicodeDecodeError, EOFError):
        return None
    pkl = records[0][1]
    if len(ops) < 6 or [o[0].name for o in ops[:3]] != ["PROTO", "EMPTY_LIST", "BINPUT"] or \
            ops[0][1] != 2 or ops[2][1] != 0 or [o[0].name for o in ops[-2:]] != [
                "APPEND", "STOP"]:
        return None
    out = bytearray(b"\x80\x02")
    for n in range(3, len(ops) - 2):
        op, arg, pos = ops[n]
        kind = _MEMO_OPS.get(op.name)
        if kind is None:
            if op.name in ("PUT", "GET", "MEMOIZE"):
                return None  # not a protocol 2 pickle of the C pickler
            out += pkl[pos:ops[n + 1][2]]
            continue
        if arg == 0:
            return None  # the payload refers to the list itself
        index = arg - 1
        if index < 256:
            out += (b"q" if kind == "PUT" else b"h") + bytes((index,))
        else:
            out += (b"r" if kind == "PUT" else b"j") + struct.pack("<I", index)
    out += b"."
    return records_archive([("data.pkl", bytes(out)), *records[1:]], names_id)
