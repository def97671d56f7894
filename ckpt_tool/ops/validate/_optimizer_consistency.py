"""``validate --deep``: the optimizer state against the model it trains.

After every step Megatron-Core's mixed-precision optimizers copy each fp32 main parameter into
its model parameter (rounded to the model's dtype), so in a checkpoint saved between steps each
stored main parameter, cast to the model's dtype, equals the stored weight bit for bit; Adam's
``exp_avg_sq`` is never negative. A parameter whose state disagrees was saved misplaced (the
``fully_reshardable`` save of Megatron-Core 0.16-0.19 with several DDP buckets slices the
per-bucket state with padded offsets) or moved to another parameter by a conversion: it is named.

The state is read in model space: the per-parameter keys of the ``fully_reshardable`` /
non-distributed forms as stored, the ``dp_reshardable`` / ``dp_zero_gather_scatter`` /
flattened forms through the proven view (:mod:`ckpt_tool.ops._optim_unflatten`). One slab of one
parameter in memory at a time.
"""

from __future__ import annotations

import re
from typing import Any

from ckpt_tool.errors import CkptError, plural
from ckpt_tool.model import CheckpointMeta, Finding
from ckpt_tool.ops.validate._checks import error, warning

__all__ = ["optimizer_model_findings"]

_MAIN = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.(?:param|fp32_param)\.(.+)$")
_SQ = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.exp_avg_sq\.(.+)$")
_SLAB_ELEMENTS = 32 << 20


def optimizer_model_findings(reader: Any, meta: CheckpointMeta, so_far: list[Finding],
                             stats: dict[str, int] | None = None) -> list[Finding]:
    """An error per parameter whose main parameter does not round to its stored weight or whose
    ``exp_avg_sq`` is negative; a warning when the state cannot be seen in model space; nothing
    for a checkpoint without optimizer state or one already reported broken. Sets
    ``stats["optimizer_params_checked"]``."""
    if any(f.severity == "error" for f in so_far) or not any(
            k.startswith(("optimizer.", "chained_")) for k in meta.tensors):
        return []
    from ckpt_tool.ops._optim_unflatten import unflatten_bucketed_optimizer

    try:
        view = unflatten_bucketed_optimizer(reader)
        vmeta = view.metadata()
    except CkptError as exc:
        return [warning("optimizer state not checked against the model: "
                        f"{getattr(exc, 'message', str(exc))}", key="optimizer")]
    out: list[Finding] = []
    checked = 0
    for key in sorted(vmeta.tensors):
        m = _MAIN.match(key)
        if m and m.group(1) in vmeta.tensors:
            bad, total = _mismatches(view, key, m.group(1), vmeta)
            checked += 1
            if bad:
                out.append(error(f"optimizer state of {m.group(1)}: the fp32 main parameter "
                                 f"does not round to the stored weight at "
                                 f"{plural(bad, 'element')} of {total} (state saved or moved "
                                 "to the wrong parameter)", key=m.group(1)))
        m = _SQ.match(key)
        if m:
            negative = _negative(view, key, vmeta)
            if negative:
                out.append(error(f"optimizer state of {m.group(1)}: exp_avg_sq is negative at "
                                 f"{plural(negative, 'element')}", key=m.group(1)))
    if stats is not None:
        stats["optimizer_params_checked"] = checked
    if not checked:
        return out + [warning("optimizer state not checked against the model: no main "
                              "parameter in model space", key="optimizer")]
    return out


def _slabs(shape: tuple[int, ...]) -> list[tuple[slice, ...] | None]:
    if not shape or shape[0] <= 1:
        return [None]
    per_row = max(1, _numel(shape[1:]))
    rows = max(1, _SLAB_ELEMENTS // per_row)
    return [(slice(i, min(i + rows, shape[0])),) for i in range(0, shape[0], rows)]


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _mismatches(view: Any, main_key: str, model_key: str,
                vmeta: CheckpointMeta) -> tuple[int, int]:
    bad = 0
    shape = tuple(vmeta.tensors[model_key].shape)
    if tuple(vmeta.tensors[main_key].shape) != shape:
        return _numel(shape), _numel(shape)
    for s in _slabs(shape):
        weight = view.read(model_key, s)
        main = view.read(main_key, s)
        bad += int((_bits(main.to(weight.dtype)) != _bits(weight)).sum())
    return bad, _numel(shape)


def _bits(t: Any) -> Any:
    """The tensor's bit patterns (bitwise equality: -0.0 differs from 0.0, a NaN equals
    itself)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().reshape(-1).view(ints[t.element_size()])


def _negative(view: Any, key: str, vmeta: CheckpointMeta) -> int:
    return sum(int((view.read(key, s) < 0).sum()) for s in _slabs(tuple(vmeta.tensors[key].shape)))
