"""The bytes items of a plain DCP checkpoint, without torch.

A plain DCP checkpoint stores each non-tensor value of the state (the common state, each
object) as ``torch.save(value)`` in a bytes item, under the key DCP's flattening gives it:

* :func:`flatten_state` is ``torch.distributed.checkpoint``'s ``flatten_state_dict`` (keys
  joined by dots, the path of each) as DCP's save applies it;
* :func:`unwrapped_archive` turns a Megatron-Core ShardedObject's stored
  ``torch.save([payload])`` into ``torch.save(payload)``, tensors included, at the byte level.

Plain values (the common state's) are pickled by :mod:`ckpt_tool.formats.containers.torch_zip.torch_save_object`.
"""

from __future__ import annotations

import io
import sys
import zipfile
from typing import Any

from ckpt_tool.errors import UnsupportedError

__all__ = ["flatten_state", "unwrapped_archive"]


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

    from ckpt_tool.formats.containers.torch_zip.torch_zip_write import records_archive

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
