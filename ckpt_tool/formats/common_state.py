"""The common state (``common.pt``) without torch, and its JSON-safe summary for ``inspect``.

A ``torch.save`` zip holds ``<archive>/data.pkl`` plus raw storages. :func:`load_torch_free`
unpickles only ``data.pkl`` through the allowlist, with tensors turned into
``TensorPlaceholder`` objects (dtype and shape, no bytes read). :func:`summarize_common` picks
what people look for (iteration, parallel and model sizes, content metadata) and
:func:`jsonable` makes any unpickled value JSON-safe.
"""

from __future__ import annotations

import argparse
import enum
import io
import os
import zipfile
from pathlib import Path, PurePath
from typing import Any

from ckpt_tool.errors import CorruptCheckpointError, InputError
from ckpt_tool.formats.containers.pickle.safe_pickle import StandIn, safe_load
from ckpt_tool.storage import as_path, is_remote

__all__ = ["load_torch_free", "summarize_common", "jsonable", "PARALLEL_ARGS",
           "MODEL_ARGS"]

PARALLEL_ARGS = {
    "tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
    "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
    "cp": "context_parallel_size", "vpp": "virtual_pipeline_model_parallel_size",
    "dp": "data_parallel_size", "world_size": "world_size",
}
MODEL_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "padded_vocab_size", "seq_length", "max_position_embeddings",
    "num_experts", "swiglu", "params_dtype", "make_vocab_size_divisible_by", "vocab_size",
    "moe_ffn_hidden_size", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)


def load_torch_free(source: str | os.PathLike | bytes, *, trust: bool = False,
                          where: str | os.PathLike | None = None,
                          torch_fallback: bool = True) -> Any:
    """The object a ``torch.save`` zip holds, tensors as placeholders; never imports torch.

    ``source`` is a path or the archive's bytes (e.g. a DCP bytes item). Falls back to the
    torch-based safe loader for the legacy (non-zip) format or a torch global without a
    stand-in; with ``torch_fallback=False`` those raise ``torch_stand_ins.NeedsTorch`` instead.
    """
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import (NeedsTorch,
                                                                     StoragePlaceholder,
                                                                     torch_free_fallback)

    if isinstance(source, (bytes, bytearray)):
        blob: Any = io.BytesIO(source)
        if not source:
            raise CorruptCheckpointError("empty torch.save payload", path=where)
    else:
        where = as_path(source)
        if not where.is_file():
            raise InputError("no such file", path=where, hint="check the path")
        if where.stat().st_size == 0:
            raise CorruptCheckpointError("empty file (zero bytes)", path=where)
        blob = where.open("rb") if is_remote(where) else where
    if not zipfile.is_zipfile(blob):
        if not torch_fallback:
            raise NeedsTorch("not a zip archive (legacy torch.save format)")
        return _load_with_torch(source, trust, where)
    try:
        with zipfile.ZipFile(blob) as zf:
            names = [n for n in zf.namelist() if n.endswith("data.pkl")]
            if not names:
                raise CorruptCheckpointError("zip file without data.pkl: not a torch.save file",
                                             path=where)
            data = zf.read(sorted(names, key=len)[0])
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise CorruptCheckpointError(f"damaged zip archive ({exc})", path=where) from None

    def persistent_load(pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            return StoragePlaceholder(str(pid[1]), int(pid[4]), str(pid[2]))
        raise CorruptCheckpointError(f"unknown persistent id {pid!r}", path=where)

    def fallback(module: str, name: str) -> Any:
        try:
            return torch_free_fallback(module, name)
        except NeedsTorch:
            raise _NeedsTorchSignal from None

    try:
        return safe_load(io.BytesIO(data), trust=trust, where=where, fallback=fallback,
                         persistent_load=persistent_load, encoding="utf-8")
    except _NeedsTorchSignal:
        if not torch_fallback:
            raise NeedsTorch("the pickle needs a torch global without a stand-in") from None
        return _load_with_torch(source, trust, where)


class _NeedsTorchSignal(BaseException):
    pass


def _load_with_torch(source: Any, trust: bool, where: Any) -> Any:
    from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file

    if isinstance(source, (bytes, bytearray)):
        try:  # (torch-free loads are for metadata: validate checks the CRCs on its own)
            return load_torch_file(io.BytesIO(source), trust=trust, map_location="cpu",
                                   verify=False)
        except CorruptCheckpointError as exc:
            exc.path = exc.path or (None if where is None else str(where))
            raise
    return load_torch_file(source, trust=trust, map_location="cpu", verify=False)


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return obj.__dict__.get(name) if hasattr(obj, "__dict__") else None


def summarize_common(state: Any) -> dict[str, Any]:
    """A JSON-safe summary of a common state dict (Megatron-LM ``common.pt``)."""
    out: dict[str, Any] = {}
    if not isinstance(state, dict):
        return {"value": jsonable(state)}
    for name in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far"):
        if name in state:
            out[name] = jsonable(state[name])
    args = state.get("args")
    if args is not None:
        parallel = {short: jsonable(_get(args, long)) for short, long in PARALLEL_ARGS.items()
                    if _get(args, long) is not None}
        if "dp" not in parallel and isinstance(parallel.get("world_size"), int):
            mp = 1
            for short in ("tp", "pp", "cp"):
                mp *= parallel.get(short) or 1
            if mp and parallel["world_size"] % mp == 0:
                parallel["dp"] = parallel["world_size"] // mp
        out["parallel"] = parallel
        out["model"] = {k: jsonable(_get(args, k)) for k in MODEL_ARGS
                        if _get(args, k) is not None}
        for k in ("ckpt_format", "use_distributed_optimizer", "fp16", "bf16"):
            if _get(args, k) is not None:
                out.setdefault("training", {})[k] = jsonable(_get(args, k))
    if "content_metadata" in state:
        out["content_metadata"] = jsonable(state["content_metadata"])
    out["keys"] = sorted(str(k) for k in state)
    return out


def jsonable(obj: Any, _depth: int = 0) -> Any:
    """Turn an unpickled value into JSON-safe data (tensors described, stand-ins as dicts)."""
    from ckpt_tool.formats.containers.pickle.torch_stand_ins import TensorPlaceholder

    if _depth > 12:
        return repr(obj)
    if isinstance(obj, str):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    d = _depth + 1
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__name__}.{obj.name}"
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(x, d) for x in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v, d) for k, v in obj.items()}
    if isinstance(obj, argparse.Namespace):
        return {k: jsonable(v, d) for k, v in vars(obj).items()}
    if isinstance(obj, PurePath):
        return str(obj)
    if isinstance(obj, bytes):
        return f"<{len(obj)} bytes>"
    if isinstance(obj, TensorPlaceholder):
        return {"tensor": obj.dtype, "shape": list(obj.shape)}
    if isinstance(obj, StandIn):
        body = {k: jsonable(v, d) for k, v in obj.fields().items()}
        return {"__class__": obj.__stand_in_for__, **body}
    mod = type(obj).__module__ or ""
    if mod.startswith("numpy"):
        if hasattr(obj, "tolist") and getattr(obj, "size", 2) <= 16:
            return jsonable(obj.tolist(), d)
        if hasattr(obj, "shape"):
            return {"array": str(getattr(obj, "dtype", "?")), "shape": list(obj.shape)}
        return str(obj)
    if mod.startswith("torch"):
        if hasattr(obj, "shape") and hasattr(obj, "dtype"):
            if obj.numel() == 1:
                return obj.item()
            return {"tensor": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
        return str(obj).removeprefix("torch.")
    return repr(obj)
