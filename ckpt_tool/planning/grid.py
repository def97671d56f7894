"""A rule for a key no rule knows, read off its source chunk grid (dist checkpoints).

The chunks of a dist checkpoint are the saving ranks' local shards (main replicas only). Along
the stacked layer axis (``decoder.layers.<name>`` keys) every layer is its own chunk; along the
other axes a tensor-parallel split shows as ``tp`` equal fragments of one axis, a replicated
tensor as a single fragment. Anything else (GLU-like interleaving, uneven fragments, a source
saved at tp=1) cannot tell, and the caller reports the key with a rule to add.
"""

from __future__ import annotations

import re

from ckpt_tool.model import TensorMeta
from ckpt_tool.planning.layout import COLUMN, REPLICATED, Rule, model_key

__all__ = ["infer_rule_from_grid"]

_STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")


def infer_rule_from_grid(meta: TensorMeta, source_tp: int) -> Rule | None:
    """``column`` along the one axis split into ``source_tp`` equal fragments, ``replicated``
    when no axis is split (and the source had tp > 1), else None."""
    if source_tp <= 1 or not meta.chunks or meta.stored_shape is not None:
        return None
    ndim = len(meta.shape)
    lead = 1 if _STACKED.search(model_key(meta.key)) and ndim >= 2 else 0
    split_axes = []
    for axis in range(lead, ndim):
        starts = sorted({c.offsets[axis] for c in meta.chunks})
        sizes = {c.sizes[axis] for c in meta.chunks}
        if len(starts) == 1:
            continue
        if len(starts) != source_tp or len(sizes) != 1:
            return None
        n = next(iter(sizes))
        if starts != [i * n for i in range(source_tp)] or n * source_tp != meta.shape[axis]:
            return None
        split_axes.append(axis)
    pattern = "^" + re.escape(meta.key) + "$"
    if not split_axes:
        return Rule(pattern, REPLICATED, origin="chunk grid")
    if len(split_axes) > 1:
        return None
    return Rule(pattern, COLUMN, axis=split_axes[0] - lead, origin="chunk grid",
                ndim=ndim - lead)
