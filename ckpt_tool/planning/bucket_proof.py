"""The proof of a rebuilt DistributedOptimizer bucket layout
(:mod:`ckpt_tool.planning.optim_buckets`) against what a ``dp_reshardable`` checkpoint stores
(pure; no I/O): every bucket's ``per_bucket_numel`` / ``per_bucket_numel_unpadded``, the key
and length of every bucket tensor, and the start of every stored piece (each parameter's part on
each DP rank, and each padding, is a piece of its own)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.planning.optim_buckets import BUCKET_KEY, STATES, Bucket

__all__ = ["prove_bucket_layout"]


def prove_bucket_layout(buckets: Sequence[Bucket], meta: CheckpointMeta,
                        per_bucket: Mapping[Any, tuple[Any, Any]], dp: int) -> list[str]:
    """Every disagreement between the rebuilt ``buckets`` and the checkpoint: the stored
    ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` (``per_bucket[(prefix,
    dp_group_idx)]``, or ``per_bucket[dp_group_idx]`` without a chained prefix; as saved: a list
    over buffers of ``{(param dtype, grad dtype): [numel, ...]}``), the bucket tensors' keys and
    lengths, and the chunk boundaries of each bucket tensor. ``dp``: the data-parallel size of
    buckets that do not carry their own."""
    problems: list[str] = []
    by_group: dict[tuple[str, int], list[Bucket]] = {}
    for b in buckets:
        by_group.setdefault(b.domain, []).append(b)
    stored_keys = {k for k in meta.tensors if BUCKET_KEY.match(k)}
    expected_keys = {b.key(s) for b in buckets for s in STATES}
    if stored_keys - expected_keys:
        problems.append(f"{plural(len(stored_keys - expected_keys), 'stored bucket tensor')} "
                        "not in the "
                        f"rebuilt layout, e.g. {sorted(stored_keys - expected_keys)[0]}")
    for (prefix, idx), group in sorted(by_group.items()):
        where = f"{prefix}dp_group_idx_{idx}"
        stored = per_bucket.get((prefix, idx), per_bucket.get(idx) if not prefix else None)
        if stored is None:
            problems.append(f"{where}: per_bucket_numel is missing")
            continue
        numel, unpadded = (_flat_numels(v) for v in stored)
        want = [b.numel for b in group], [b.numel_unpadded for b in group]
        if (numel, unpadded) != want:
            problems.append(f"{where}: rebuilt buckets of {want[0]} elements "
                            f"({want[1]} unpadded), stored per_bucket_numel {numel} "
                            f"({unpadded} unpadded)")
            continue
        for b in group:
            problems += _prove_chunks(b, meta, b.dp or dp)
    return problems


def _flat_numels(value: Any) -> list[int]:
    out: list[int] = []
    for per_dtype in value or []:
        for numels in dict(per_dtype).values():
            out += [int(n) for n in numels]
    return out


def _prove_chunks(b: Bucket, meta: CheckpointMeta, dp: int) -> list[str]:
    local = b.numel // dp
    points = {0} | {r * local for r in range(dp)}
    spans: list[tuple[int, int]] = []
    for p in b.params:
        if p.continues and spans:
            spans[-1] = (spans[-1][0], p.start + p.numel)
        else:
            spans.append((p.start, p.start + p.numel))
    for start, end in spans:
        points |= {start, end}
    want = sorted(x for x in points if x < b.numel_unpadded)
    out = []
    for state in STATES:
        t = meta.tensors.get(b.key(state))
        if t is None:
            out.append(f"{b.key(state)}: missing")
            continue
        if tuple(t.shape) != (b.numel_unpadded,):
            out.append(f"{b.key(state)}: {list(t.shape)} stored, {b.numel_unpadded} rebuilt")
            continue
        got = sorted(c.offsets[0] for c in t.chunks)
        if got != want:
            diff = sorted(set(got) ^ set(want))
            out.append(f"{b.key(state)}: stored pieces start at {len(got)} offsets, the rebuilt "
                       f"layout at {len(want)} (first difference at element {diff[0]})")
    return out
