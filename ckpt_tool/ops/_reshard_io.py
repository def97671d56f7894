"""Byte moving for ``reshard``: a stacked view of legacy checkpoints, a source that re-pads the
vocabulary, and the per-rank legacy files written from a ``ReshardPlan``.

Megatron-Core dist checkpoints store transformer layers stacked (``decoder.layers.<rest>`` with
the layer axis first); legacy files hold one key per layer (``decoder.layers.<n>.<rest>``).
``StackedView`` presents a legacy checkpoint the dist way (so its output loads into a
Megatron-Core model); ``write_legacy_ranks`` unstacks dist keys into per-layer legacy keys.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from ckpt_tool.formats.legacy.layout import LOCAL_TO_DIST_NAMES
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, TensorMeta

__all__ = ["StackedView", "PaddedSource", "stacked_view_if_legacy", "reshard_source"]

_PER_LAYER = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)(\d+)\.(.*)$")
_STACKED = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)([^0-9].*)$")


class StackedView(Reader):
    """A legacy reader's per-layer keys as Megatron-Core dist keys: a leading layer axis, and
    for routed experts (``…local_experts.<e>.…``) a second, global-expert axis under the
    name Megatron-Core's SequentialMLP saves (``…mlp.experts.experts.…``)."""

    format_name = "legacy"

    def __init__(self, reader: Reader):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self._meta: CheckpointMeta | None = None
        self._parts: dict[str, dict[tuple[int, ...], str]] = {}

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    def metadata(self) -> CheckpointMeta:
        if self._meta is not None:
            return self._meta
        meta = self.inner.metadata()
        groups: dict[str, dict[tuple[int, ...], TensorMeta]] = {}
        tensors: dict[str, TensorMeta] = {}
        moe_layers = {m.group(2) for k in meta.tensors if (m := _PER_LAYER.match(k))
                      and (".mlp.router." in k or ".mlp.experts." in k)}
        for key, t in meta.tensors.items():
            m = _PER_LAYER.match(key)
            if m is None:
                tensors[key] = t
                continue
            rest = _dist_name(m.group(3), moe=m.group(2) in moe_layers)
            index: tuple[int, ...] = (int(m.group(2)),)
            e = _LOCAL_EXPERT.match(rest)
            if e is not None:
                rest, index = f"{e.group(1)}experts.{e.group(3)}", index + (int(e.group(2)),)
            groups.setdefault(m.group(1) + rest, {})[index] = t
        for key, parts in groups.items():
            first = next(iter(parts.values()))
            grid = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
            if len(parts) != math.prod(grid) or any(
                    (t.shape, t.dtype) != (first.shape, first.dtype) for t in parts.values()):
                for t in parts.values():  # not a regular stack: keep the per-layer keys
                    tensors[t.key] = t
                continue
            lead = (1,) * len(grid)
            chunks = tuple(replace(c, offsets=(*i, *c.offsets), sizes=(*lead, *c.sizes))
                           for i in sorted(parts) for c in parts[i].chunks)
            tensors[key] = TensorMeta(key=key, dtype=first.dtype, shape=(*grid, *first.shape),
                                      chunks=chunks)
            self._parts[key] = {i: t.key for i, t in parts.items()}
        self._meta = replace(meta, tensors=tensors)
        return self._meta

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        import itertools

        import torch

        meta = self.metadata()
        if key not in self._parts:
            return self.inner.read(key, slices)
        parts = self._parts[key]
        n_lead = len(next(iter(parts)))
        shape = meta.tensors[key].shape
        slices = tuple(slices or ())
        lead = [range(*(slices[d] if d < len(slices) else slice(None)).indices(shape[d]))
                for d in range(n_lead)]
        rest = slices[n_lead:] or None
        pieces = [self.inner.read(parts[i], rest) for i in itertools.product(*lead)]
        out = torch.stack(pieces) if pieces else torch.empty(0)
        return out.reshape(*(len(r) for r in lead), *out.shape[1:])

    def read_object(self, unique_key: str) -> Any:
        return self.inner.read_object(unique_key)

    def common(self) -> dict[str, Any]:
        return self.inner.common()

    def close(self) -> None:
        self.inner.close()


_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(.*)$")




def _dist_name(rest: str, *, moe: bool) -> str:
    for old, new in LOCAL_TO_DIST_NAMES:
        if rest.startswith(old) and not (moe and old.startswith("pre_mlp")):
            return new + rest[len(old):]
    return rest


class PaddedSource:
    """Reads target keys from ``reader``; rows of re-padded vocab tensors beyond the source's
    rows are zeros (``fill="zero"``) or copies of the last stored row (``"copy"``).

    With ``raw`` (a :class:`ckpt_tool.ops._raw_source.RawSource` over the same reader) the
    pieces are numpy arrays of the elements' bytes, read without torch, and copied rows are
    byte copies (``raw_bytes``: the torch_dist writer takes them as they are); ``"zero"``
    fill goes through torch (its zeros are ``row * 0``: signed, NaN for non-finite values)."""

    def __init__(self, reader: Reader, target: CheckpointMeta, fill: str = "copy",
                 progress: Any = None, raw: Any = None):
        self.reader = reader
        self.fill = fill
        src = reader.metadata().tensors
        self.rows = {k: src[k].shape[0] for k, t in target.tensors.items()
                     if k in src and t.shape and src[k].shape and t.shape[0] != src[k].shape[0]}
        if raw is not None and self.rows and fill != "copy":
            raise ValueError("raw pieces re-pad by copying rows only")
        self.raw = raw
        self.raw_bytes = raw is not None
        self.largest_piece = 0

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        rows = self.rows.get(key)
        if rows is None or offsets[0] + sizes[0] <= rows:
            out = self._read(key, offsets, sizes)
            if self.raw is None:
                out = out.contiguous()
        elif self.raw is not None:
            out = self._padded_raw(key, offsets, sizes, rows)
        else:
            out = self._padded(key, offsets, sizes, rows)
        n = out.nbytes if self.raw is not None else out.numel() * out.element_size()
        self.largest_piece = max(self.largest_piece, n)
        return out

    def _padded(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                rows: int) -> Any:
        import torch

        have = max(0, rows - offsets[0])
        parts = []
        if have:
            parts.append(self._read(key, offsets, (have, *sizes[1:])))
        extra = sizes[0] - have
        last = self._read(key, (rows - 1, *offsets[1:]), (1, *sizes[1:]))
        if self.fill == "zero":
            last = last.mul(0)
        parts.append(last.expand(extra, *sizes[1:]))
        return torch.cat(parts).contiguous()

    def _padded_raw(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                    rows: int) -> Any:
        import numpy as np

        have = max(0, rows - offsets[0])
        last = self._read(key, (rows - 1, *offsets[1:]), (1, *sizes[1:]))
        out = np.empty(sizes, dtype=last.dtype)
        if have:
            out[:have] = self._read(key, offsets, (have, *sizes[1:]))
        out[have:] = last  # the last stored row, copied into every new row
        return out

    def _read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        if self.raw is not None:
            return self.raw.read(key, offsets, sizes)
        slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        return self.reader.read(key, slices or None)


def stacked_view_if_legacy(reader: Reader, target_format: str) -> Reader:
    """Legacy sources become stacked for dist targets (Megatron-Core's key layout)."""
    if reader.metadata().format == "legacy" and target_format != "legacy":
        return StackedView(reader)
    return reader


def reshard_source(reader: Reader, target: CheckpointMeta, fill: str, to: str) -> PaddedSource:
    """The source a reshard's writer pulls from: torch-free numpy pieces
    (:class:`ckpt_tool.ops._raw_source.RawSource`) for a torch_dist target when every target
    tensor is a source tensor of the same dtype whose chunks are plain items and whose dtype
    our archive writer takes, and a re-padded vocabulary copies rows; else torch tensors."""
    from ckpt_tool.formats.torch_zip_write import STORAGE_TYPES
    from ckpt_tool.ops._raw_source import RawSource, raw_source_applies

    src = reader.metadata().tensors
    key_map = {k: k for k in target.tensors}
    raw = (to == "torch_dist" and all(k in src and src[k].dtype == t.dtype
                                      and t.dtype in STORAGE_TYPES
                                      for k, t in target.tensors.items())
           and raw_source_applies(reader, key_map, {}))
    source = PaddedSource(reader, target, fill=fill)
    if raw and (fill == "copy" or not source.rows):
        source = PaddedSource(reader, target, fill=fill, raw=RawSource(reader, key_map, {}))
    return source

