"""Exact-cover checks for the sharded values of all ranks (used by ``validation``).

Only main replicas are saved, so for each key they must tile the global tensor exactly: every
element stored once, none twice. Each check raises CheckpointingException naming the key and
what is wrong.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import product
from typing import Dict, List, Sequence, Tuple

from .core import CheckpointingException
from .mapping import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

__all__ = ["group_by_key", "check_tensor_shards", "check_object_shards"]

RankEntry = Tuple[int, ShardedBase]
_SHOWN = 8  # how many offending chunks an error message lists


def group_by_key(global_metadata: Sequence[Sequence[ShardedBase]]) -> Dict[str, List[RankEntry]]:
    """``{key: [(rank, sharded value), ...]}`` in rank order."""
    grouped: Dict[str, List[RankEntry]] = defaultdict(list)
    for rank, rank_values in enumerate(global_metadata):
        for sh in rank_values:
            grouped[sh.key].append((rank, sh))
    return dict(grouped)


def _fail(first: ShardedBase, problem: str) -> None:
    raise CheckpointingException(f"Invalid access pattern for {first}: {problem}")


def _shorten(items) -> str:
    items = list(items)
    more = f" ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
    return f"{items[:_SHOWN]}{more}"


def check_tensor_shards(key: str, entries: List[RankEntry]) -> None:
    """Check one key's ShardedTensors from all ranks (see module docstring)."""
    first: ShardedTensor = entries[0][1]
    flat = first.flattened_range is not None
    for rank, sh in entries:
        for attr in ("dtype", "global_shape", "has_regular_grid"):
            if getattr(sh, attr) != getattr(first, attr):
                _fail(first, f"rank {rank} has {attr}={getattr(sh, attr)} instead of "
                      f"{getattr(first, attr)}")
        if (sh.flattened_range is not None) != flat:
            _fail(first, f"rank {rank} mixes flattened and non-flattened shards")
        if first.has_regular_grid and (
            tuple(sh.local_shape) != tuple(first.local_shape)
            or tuple(sh.axis_fragmentations) != tuple(first.axis_fragmentations)
        ):
            _fail(first, f"rank {rank} has local_shape={tuple(sh.local_shape)} / "
                  f"axis_fragmentations={sh.axis_fragmentations}, unlike rank {entries[0][0]}")

    main = [sh for _, sh in entries if is_main_replica(sh.replica_id)]
    if first.has_regular_grid:
        _check_grid(first, main)
    elif not flat:
        _check_boxes(first, main)
    # irregular flattened shards are left to the storage layer, as in Megatron-Core


def _check_grid(first: ShardedTensor, main: List[ShardedTensor]) -> None:
    """Regular grid: each grid cell is held by exactly one main replica (or, for flattened
    shards, its flattened ranges tile the cell exactly)."""
    grid = tuple(first.axis_fragmentations)
    if math.prod(first.local_shape) == 0:
        return  # empty pieces: nothing to store
    cells: Dict[tuple, List[ShardedTensor]] = defaultdict(list)
    for sh in main:
        cell = sh.local_chunk_offset_in_global()
        if len(cell) != len(grid) or not all(0 <= c < g for c, g in zip(cell, grid)):
            _fail(first, f"chunk at global offset {sh.global_offset} lies outside the grid {grid}")
        cells[cell].append(sh)

    if len(cells) != math.prod(grid):
        missing = [c for c in product(*(range(g) for g in grid)) if c not in cells]
        _fail(first, f"{len(missing)} chunk(s) saved by no main replica: {_shorten(missing)}")
    if first.flattened_range is None:
        repeated = {c: len(v) for c, v in cells.items() if len(v) > 1}
        if repeated:
            _fail(first, f"chunk(s) saved more than once (cell, count): "
                  f"{_shorten(repeated.items())}")
        return
    size = math.prod(first.local_shape)
    for cell, shards in cells.items():
        ranges = sorted((sh.flattened_range.start, sh.flattened_range.stop) for sh in shards)
        expected_start = 0
        for start, stop in ranges:
            if start != expected_start:
                kind = "overlap" if start < expected_start else "gap"
                _fail(first, f"flattened ranges of chunk {cell} have a {kind} at {start}: {ranges}")
            expected_start = stop
        if expected_start != size:
            _fail(first, f"flattened ranges of chunk {cell} end at {expected_start}, "
                  f"not at the chunk size {size}: {ranges}")


def _check_boxes(first: ShardedTensor, main: List[ShardedTensor]) -> None:
    """Irregular sharding: main-replica boxes stay in bounds, do not overlap and their
    volumes add up to the global volume (together: an exact cover)."""
    shape = tuple(first.global_shape)
    boxes = []
    for sh in main:
        lo = tuple(sh.global_offset)
        hi = tuple(o + s for o, s in zip(lo, (1,) * sh.prepend_axis_num + tuple(sh.local_shape)))
        if math.prod(h - l for l, h in zip(lo, hi)) == 0:
            continue
        if any(l < 0 or h > g for l, h, g in zip(lo, hi, shape)):
            _fail(first, f"chunk {lo}..{hi} exceeds the global shape {shape}")
        boxes.append((lo, hi))
    boxes.sort()
    # sweep along axis 0: only boxes whose axis-0 ranges intersect can overlap
    active: List[Tuple[tuple, tuple]] = []
    for lo, hi in boxes:
        active = [b for b in active if b[1][0] > lo[0]]
        for other_lo, other_hi in active:
            if all(max(a, b) < min(c, d) for a, b, c, d in zip(lo, other_lo, hi, other_hi)):
                _fail(first, f"chunks {other_lo}..{other_hi} and {lo}..{hi} overlap")
        active.append((lo, hi))
    covered = sum(math.prod(h - l for l, h in zip(lo, hi)) for lo, hi in boxes)
    if covered != math.prod(shape):
        _fail(first, f"main replicas cover {covered} of {math.prod(shape)} elements")


def check_object_shards(key: str, entries: List[RankEntry]) -> None:
    """Each cell of a ShardedObject grid is saved by exactly one main replica."""
    first: ShardedObject = entries[0][1]
    shape = tuple(first.global_shape)
    for rank, sh in entries:
        if tuple(sh.global_shape) != shape:
            raise CheckpointingException(
                f"ShardedObject {key!r}: rank {rank} has global_shape {tuple(sh.global_shape)}, "
                f"rank {entries[0][0]} has {shape}"
            )
    main = [sh for _, sh in entries if is_main_replica(sh.replica_id)]
    counts = Counter(sh.unique_key for sh in main)
    duplicates = sorted(k for k, n in counts.items() if n > 1)
    if duplicates:
        raise CheckpointingException(f"Duplicate ShardedObject keys: {duplicates}")
    outside = [sh.unique_key for sh in main
               if not all(0 <= o < s for o, s in zip(sh.global_offset, shape))]
    if outside:
        raise CheckpointingException(
            f"ShardedObject offsets outside the global shape {shape}: {_shorten(outside)}"
        )
    expected = math.prod(shape)
    if len(counts) != expected:
        raise CheckpointingException(
            f"Invalid access pattern: {expected - len(counts)} ShardedObject are missing. "
            f"Existing shards: {_shorten(sorted(counts))}"
        )
