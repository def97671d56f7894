"""Pure index arithmetic behind ``mapping``: rank offsets, flattened ranges, object keys.

A flattened shard (``ShardedTensor.flattened_range``) holds the contiguous slice
``[start, stop)`` of the row-major flattening of a local piece of shape ``local_shape``.
Keeping this integer/numpy code here lets ``mapping`` stay about the mapping itself.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "layout_from_rank_offsets",
    "flattened_range_problem",
    "flat_local_coordinates",
    "narrow_flattened_range",
    "parse_object_unique_key",
]

Layout = Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]


def layout_from_rank_offsets(
    key: str, local_shape: Sequence[int], rank_offsets: Sequence[Tuple[int, int, int]],
    prepend_axis_num: int,
) -> Layout:
    """``(global_shape, global_offset, axis_fragmentations)`` of a regular-grid shard.

    Each ``(axis, rank_on_axis, fragments)`` cuts global ``axis`` (prepended axes count, with
    local size 1) into ``fragments`` equal pieces of which the shard is number ``rank_on_axis``.
    Raises ValueError with a message naming ``key`` on invalid triples.
    """
    axis_len = [1] * prepend_axis_num + list(local_shape)
    ndim = len(axis_len)
    shape, offset, fragmentations = list(axis_len), [0] * ndim, [1] * ndim
    for axis, rank_on_axis, fragments in rank_offsets:
        if axis < 0 or rank_on_axis < 0 or fragments < 1 or rank_on_axis >= fragments:
            raise ValueError(f"Invalid rank offsets: {tuple(rank_offsets)} for key {key}.")
        if axis >= ndim:
            raise ValueError(
                f"Rank offset axis {axis} out of range for a {ndim}-D global tensor (key {key})."
            )
        shape[axis] = fragments * axis_len[axis]
        offset[axis] = rank_on_axis * axis_len[axis]
        fragmentations[axis] = fragments
    return tuple(shape), tuple(offset), tuple(fragmentations)


def flattened_range_problem(rng: object, local_shape: Sequence[int]) -> Optional[str]:
    """Describe what is wrong with ``rng`` as a flattened range of ``local_shape``, or None."""
    if not isinstance(rng, slice):
        return f"`flattened_range` must be a slice, got {type(rng).__name__}"
    if rng.step is not None:
        return "`step` argument in the flattened range of a ShardedTensor is not supported."
    if rng.start is None or rng.stop is None:
        return f"`flattened_range` {rng} needs both start and stop"
    if not 0 <= rng.start <= rng.stop <= math.prod(local_shape):
        return f"`flattened_range` {rng} out of bounds of local shape {tuple(local_shape)}"
    return None


def flat_local_coordinates(rng: slice, local_shape: Sequence[int]) -> Tuple[np.ndarray, ...]:
    """Per-axis indices (into the local piece) of the elements covered by ``rng``."""
    flat_idx = np.arange(rng.start, rng.stop)
    return tuple(np.unravel_index(flat_idx, tuple(local_shape)))


def narrow_flattened_range(
    rng: slice, local_shape: Sequence[int], start: int, length: int
) -> Optional[Tuple[slice, int, int]]:
    """Narrow axis 0 of a flattened shard to ``[start, start + length)``.

    Returns ``(new_range, data_lo, data_hi)``: the flattened range relative to the narrowed
    piece and the slice ``data[data_lo:data_hi]`` of the old flat data that it holds; None if
    the shard holds nothing of the narrowed part.
    """
    row = math.prod(local_shape[1:])  # elements per index along axis 0
    lo = rng.start - start * row
    hi = rng.stop - start * row
    new_lo, new_hi = max(lo, 0), min(hi, length * row)
    if new_lo >= new_hi:
        return None
    return slice(new_lo, new_hi), new_lo - lo, new_hi - lo


def parse_object_unique_key(unique_key: str) -> Tuple[str, Tuple[int, ...], Tuple[int, ...]]:
    """Split ``<key>/shard_<offset>_<shape>`` into ``(key, offset, shape)``.

    Old checkpoints may lack trailing global-shape elements (or the whole shape part); the
    unknown sizes are returned as -1. Raises ValueError for anything else.
    """
    key, sep, shard = unique_key.rpartition("/")
    parts = shard.split("_")
    if not sep or parts[0] != "shard" or len(parts) not in (2, 3):
        raise ValueError(f"Not a ShardedObject unique key: {unique_key!r}")
    offset = tuple(int(i) for i in parts[1].split("."))
    shape = tuple(int(i) for i in parts[2].split(".")) if len(parts) == 3 else ()
    return key, offset, shape + (-1,) * (len(offset) - len(shape))
