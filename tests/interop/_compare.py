"""Compare what our library reads from a checkpoint with what the real Megatron-Core reads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

WORKERS = Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"
sys.path.insert(0, str(WORKERS))

from launch import torchrun  # noqa: E402
from plainify import plainify  # noqa: E402


def mcore_view(ckpt: Path, out: Path) -> dict:
    """Megatron-Core's load_plain_tensors / load_tensors_metadata / common / objects."""
    torchrun("mcore_inspect.py", 1, str(ckpt), str(out), timeout=600)
    return torch.load(out, weights_only=False)


def ours_view(ckpt: Path) -> dict:
    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing import ShardedObject, serialization

    meta = {k: (v.dtype, tuple(v.global_shape))
            for k, v in dc.load_tensors_metadata(str(ckpt)).items()}
    plain = {k: v for k, v in dc.load_plain_tensors(str(ckpt)).items() if k in meta}
    objects = {}
    for key, sh in serialization.load_sharded_metadata(str(ckpt)).items():
        if isinstance(sh, ShardedObject):
            objects[key] = dc.load({"o": sh}, str(ckpt), validate_access_integrity=False)["o"]
    return {"plain": plain, "meta": meta,
            "common": plainify(dc.load_common_state_dict(str(ckpt))), "objects": plainify(objects)}


def same_value(a, b) -> bool:
    """Deep equality: tensors bit-exact (dtype too), Namespaces/StandIns by their fields."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
                    and torch.equal(a.isnan(), b.isnan())) if a.is_floating_point() \
            else bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and hasattr(b, "__dict__") and not isinstance(a, type):
        return same_value(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return repr(a) == repr(b)
