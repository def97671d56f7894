"""A Megatron-Core dist checkpoint holding two common states, ``common.pt`` and the
``common_state`` object of Megatron-Core 0.19 (``formats.mcore_dist.forms``), compared for
``validate``: both loaded without torch (tensors as placeholders: their dtypes and shapes are
compared, not their values), then made JSON-safe and compared field by field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_tool.model import CheckpointMeta

__all__ = ["common_state_differences", "differences"]


def common_state_differences(root: Path, meta: CheckpointMeta, unique_key: str,
                             trust: bool) -> list[str] | None:
    """How ``common.pt`` and the object ``unique_key`` differ (``"args.tensor_model_parallel_
    size: 2 vs 1"``, file first; empty when they are the same), or None when either cannot be
    read (what is wrong with it is reported on its own)."""
    from ckpt_tool.errors import CkptError
    from ckpt_tool.formats.common_state import jsonable, load_torch_free
    from ckpt_tool.formats.containers.dcp.dcp_items import read_item_bytes

    obj = next((o for o in meta.objects if o.unique_key == unique_key), None)
    if obj is None or obj.file is None:
        return None
    try:
        in_file = load_torch_free(root / "common.pt", trust=trust)
        data = read_item_bytes(root, obj.file, obj.byte_offset, obj.byte_length)
        payload = load_torch_free(data, trust=trust, where=root / obj.file)
    except (CkptError, OSError):
        return None
    if isinstance(payload, list) and len(payload) == 1:  # torch.save([state])
        payload = payload[0]
    return differences(jsonable(in_file), jsonable(payload))


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths (dotted) where JSON-safe values ``a`` and ``b`` differ, with both values
    (``<absent>`` for a missing key). Pure."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                out.append(f"{sub}: {_short(a.get(k, '<absent>'))} vs "
                           f"{_short(b.get(k, '<absent>'))}")
            else:
                out += differences(a[k], b[k], sub)
        return out
    return [] if a == b else [f"{path or 'the state'}: {_short(a)} vs {_short(b)}"]


def _short(value: Any, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
