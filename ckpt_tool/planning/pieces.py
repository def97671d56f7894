"""A rank's local tensor of one key as rectangles of the global tensor (and back).

:func:`tp_pieces` splits one module tensor (no stacked axes) for one TP rank;
:func:`rank_pieces` adds the stacked layer/expert axes of dist keys and returns every piece a
rank holds, one per stored chunk as Megatron-Core writes them (per layer, per expert, GLU
halves separately). :func:`global_pieces` is the inverse view used by readers of per-rank
files: where each rank's local tensor lands in the global tensor.

A :class:`Piece` either reads ``global_offsets``/``sizes`` from the source global tensor, or
is a fill (``fill="zero"``, or ``fill="copy"``: every row is a copy of source row
``fill_row``), used for vocab rows beyond the source's padded vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ckpt_tool.planning.layout import (COLUMN, GLU, QKV, REPLICATED, ROW, VOCAB, Rule,
                                       leading_axes, stacked_expert_axis)

__all__ = ["Piece", "LocalTensor", "tp_pieces", "rank_pieces", "global_pieces",
           "effective_kind", "split_tp", "FILL_ZERO", "FILL_COPY"]

FILL_ZERO, FILL_COPY = "zero", "copy"


@dataclass(frozen=True)
class Piece:
    """``sizes`` elements at ``global_offsets`` of the global tensor go to ``local_offsets`` of
    the rank-local tensor. ``fill`` set: no source bytes (zero rows or copies of
    ``fill_row``)."""

    global_offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_offsets: tuple[int, ...]
    fill: str | None = None
    fill_row: int | None = None

    def to_dict(self) -> dict[str, object]:
        d: dict[str, object] = {"global_offsets": list(self.global_offsets),
                                "sizes": list(self.sizes),
                                "local_offsets": list(self.local_offsets)}
        if self.fill:
            d["fill"] = self.fill
            if self.fill_row is not None:
                d["fill_row"] = self.fill_row
        return d


@dataclass(frozen=True)
class LocalTensor:
    """What one rank holds of one key."""

    key: str
    local_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def effective_kind(rule: Rule, gated: bool) -> str:
    """``glu`` without a gated linear unit splits like ``column``; ``qkv`` is ``column``."""
    if rule.kind == GLU and not gated:
        return COLUMN
    if rule.kind == QKV:
        return COLUMN
    return rule.kind


def split_tp(extent: int, tp: int, what: str = "axis") -> int:
    """``extent // tp``; ValueError when it does not divide."""
    if tp <= 0 or extent % tp:
        raise ValueError(f"{what} of size {extent} does not split over {tp} tensor-parallel "
                         "ranks")
    return extent // tp


def _split_vocab(p: Piece, axis: int, source_rows: int | None, fill: str) -> list[Piece]:
    """Cut ``p`` at ``source_rows`` along ``axis``: rows beyond become fill pieces."""
    start, n = p.global_offsets[axis], p.sizes[axis]
    if source_rows is None or start + n <= source_rows:
        return [p]
    out = []
    keep = max(source_rows - start, 0)
    if keep:
        sizes = list(p.sizes)
        sizes[axis] = keep
        out.append(Piece(p.global_offsets, tuple(sizes), p.local_offsets))
    goff, loff, sizes = list(p.global_offsets), list(p.local_offsets), list(p.sizes)
    goff[axis] += keep
    loff[axis] += keep
    sizes[axis] = n - keep
    out.append(Piece(tuple(goff), tuple(sizes), tuple(loff), fill=fill,
                     fill_row=source_rows - 1 if fill == FILL_COPY else None))
    return out


def tp_pieces(kind: str, shape: Sequence[int], axis: int | None, tp: int, rank: int, *,
              source_rows: int | None = None, fill: str = FILL_COPY
              ) -> tuple[tuple[int, ...], list[Piece]]:
    """``(local shape, pieces)`` of TP rank ``rank`` of a module tensor of global ``shape``.

    ``kind`` is an effective kind (see :func:`effective_kind`); for ``vocab``, rows at or
    beyond ``source_rows`` (the source's padded vocab) are fill pieces."""
    shape = tuple(int(s) for s in shape)
    zeros = (0,) * len(shape)
    if kind == REPLICATED or tp == 1 and kind not in (VOCAB, GLU):  # GLU: 2 chunks, as MCore
        return shape, [Piece(zeros, shape, zeros)]
    assert axis is not None and 0 <= axis < len(shape), (kind, shape, axis)
    if kind == GLU:
        half = split_tp(shape[axis], 2, "gated linear_fc1 rows")
        n = split_tp(half, tp, "gated linear_fc1 half")
        local = list(shape)
        local[axis] = 2 * n
        pieces = []
        for i, start in enumerate((rank * n, half + rank * n)):
            goff, loff, sizes = list(zeros), list(zeros), list(shape)
            goff[axis], loff[axis], sizes[axis] = start, i * n, n
            pieces.append(Piece(tuple(goff), tuple(sizes), tuple(loff)))
        return tuple(local), pieces
    if kind not in (COLUMN, ROW, VOCAB):
        raise ValueError(f"unknown split kind {kind!r}")
    n = split_tp(shape[axis], tp)
    local = list(shape)
    local[axis] = n
    goff = list(zeros)
    goff[axis] = rank * n
    piece = Piece(tuple(goff), tuple(local), zeros)
    if kind == VOCAB:
        return tuple(local), _split_vocab(piece, axis, source_rows, fill)
    return tuple(local), [piece]


def rank_pieces(key: str, global_shape: Sequence[int], rule: Rule, *, tp: int, tp_rank: int,
                gated: bool = True, layers: Sequence[int] | None = None,
                experts: Sequence[int] | None = None, source_rows: int | None = None,
                fill: str = FILL_COPY) -> list[LocalTensor]:
    """Every local tensor a rank holds of ``key``: one per stacked layer (``layers``: the
    global layers of the rank's pipeline stage; None = all) and expert (``experts``: the
    rank's global experts; None = all), each with its pieces in global coordinates. For an
    expert rule ``tp``/``tp_rank`` are the expert-tensor-parallel size/rank.

    A key without stacked axes gives one local tensor."""
    shape = tuple(int(s) for s in global_shape)
    lead = leading_axes(key, len(shape), rule)
    module_shape = shape[lead:]
    kind = effective_kind(rule, gated)
    axis = rule.axis
    if kind == VOCAB and source_rows is not None and source_rows >= module_shape[axis or 0]:
        source_rows = None
    local_shape, base = tp_pieces(kind, module_shape, axis, tp, tp_rank,
                                  source_rows=source_rows, fill=fill)
    stacked: list[list[int]] = []
    for i in range(lead):
        is_expert = i == lead - 1 and stacked_expert_axis(key, rule)
        choice = experts if is_expert else (layers if i == 0 else None)
        stacked.append(list(range(shape[i])) if choice is None
                       else [c for c in choice if 0 <= c < shape[i]])
    combos: list[tuple[int, ...]] = [()]
    for values in stacked:
        combos = [c + (v,) for c in combos for v in values]
    out = []
    for combo in combos:
        ones = (1,) * lead
        pieces = tuple(Piece(combo + p.global_offsets, ones + p.sizes,
                             (0,) * lead + p.local_offsets, p.fill,
                             p.fill_row) for p in base)
        out.append(LocalTensor(key, ones + local_shape, pieces))
    return out


def global_pieces(key: str, local_shape: Sequence[int], rule: Rule, *, tp: int, tp_rank: int,
                  gated: bool = True) -> tuple[tuple[int, ...], list[Piece]]:
    """The inverse view for per-rank files: ``(global shape, pieces)`` placing a rank's local
    module tensor (no stacked axes) of ``local_shape`` into the global tensor."""
    kind = effective_kind(rule, gated)
    local = tuple(int(s) for s in local_shape)
    if kind == REPLICATED or tp == 1:
        return local, tp_pieces(REPLICATED, local, None, 1, 0)[1]
    axis = rule.axis
    assert axis is not None
    gshape = list(local)
    gshape[axis] *= tp
    if kind == VOCAB:
        kind = COLUMN
    return tuple(gshape), tp_pieces(kind, gshape, axis, tp, tp_rank)[1]
