"""``validate --deep``: read every tensor that the integrity pass did not already count in
place, and count its NaN/Inf elements (big tensors in slabs along dim 0)."""

from __future__ import annotations

from typing import Any, Iterator

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.ops.validate._checks import error, warning
from ckpt_tool.model import Finding

__all__ = ["deep_read"]

_DEEP_SLAB_BYTES = 256 << 20


def _slabs(meta: Any) -> Iterator[tuple[slice, ...] | None]:
    """Read big tensors in slabs along dim 0 (about ``_DEEP_SLAB_BYTES`` each), one at a time
    (a shape the metadata makes absurd, 10**15 rows, costs the slabs read before the first
    failure, not a list of them)."""
    if not meta.shape or meta.stored_shape is not None or meta.shape[0] <= 1 \
            or meta.nbytes <= _DEEP_SLAB_BYTES:
        yield None
        return
    rows = max(1, _DEEP_SLAB_BYTES * meta.shape[0] // max(1, meta.nbytes))
    for i in range(0, meta.shape[0], rows):
        yield (slice(i, min(i + rows, meta.shape[0])),)


def _nan_inf(t: Any) -> tuple[int, int]:
    from ckpt_tool.ops.validate._checks import nonfinite

    return nonfinite(t)


def deep_read(reader: Any, meta: CheckpointMeta, so_far: list[Finding], stats: dict[str, int],
              counted: dict[str, tuple[int, int]],
              nonfinite: dict[str, tuple[int, int, int]] | None = None,
              progress: Any = None) -> list[Finding]:
    """Read every tensor not already reported broken; NaN/Inf counts per tensor (``counted``:
    those already counted in place by the integrity pass) become warnings, and go into
    ``nonfinite`` as ``(nan, inf, elements)`` for each tensor that has any. ``progress`` is
    told the bytes and the tensors read (those not counted already)."""
    errors = [f for f in so_far if f.severity == "error"]
    broken_keys = {f.key for f in errors if f.key}
    broken_files = {f.file for f in errors if f.file}
    out: list[Finding] = []
    read = 0
    keys = [k for k in sorted(meta.tensors) if k not in broken_keys  # already reported: a
            and not any(c.file in broken_files for c in meta.tensors[k].chunks)]  # read repeats
    to_read = [k for k in keys if k not in counted]
    tensors_done = 0
    if progress is not None and to_read:
        progress.start(sum(meta.tensors[k].nbytes for k in to_read), len(to_read),
                       unit="tensor")
    for key in keys:
        tm = meta.tensors[key]
        nan = inf = 0
        if key in counted:
            nan, inf = counted[key]
        else:
            reported = 0  # bytes told to ``progress`` so far
            try:
                for sl in _slabs(tm):
                    t = reader.read(key, sl)
                    try:
                        n, i = _nan_inf(t)
                    except Exception as exc:  # noqa: BLE001
                        out.append(warning(f"cannot count NaN/Inf ({type(exc).__name__}: "
                                           f"{exc})", key=key))
                        break
                    nan, inf = nan + n, inf + i
                    del t
                    if progress is not None and sl is not None:
                        nbytes = (sl[0].stop - sl[0].start) * (tm.nbytes // tm.shape[0])
                        progress.update(nbytes, tensors_done)
                        reported += nbytes
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                msg = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                out.append(error(f"cannot read the tensor: {msg}", key=key))
                continue
            finally:
                tensors_done += 1
                if progress is not None:
                    progress.update(max(0, tm.nbytes - reported), tensors_done)
        read += 1
        if nan or inf:
            if nonfinite is not None:
                nonfinite[key] = (nan, inf, tm.numel)
            out.append(warning(f"{nan} NaN and {inf} Inf of {plural(tm.numel, 'element')}",
                               key=key))
    stats["tensors_read"] = read
    return out
