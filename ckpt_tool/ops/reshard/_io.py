"""Byte moving for ``reshard``: a source that re-pads the vocabulary (a legacy source is seen
stacked for dist targets: :mod:`ckpt_tool.ops._stacked_view`)."""

from __future__ import annotations

import math
from typing import Any

from ckpt_tool.formats.base import Reader
from ckpt_tool.formats.writer import writer_for
from ckpt_tool.model import CheckpointMeta

__all__ = ["PaddedSource", "reshard_source"]


class PaddedSource:
    """Reads target keys from ``reader``; rows of re-padded vocab tensors beyond the source's
    rows are zeros (``fill="zero"``) or copies of the last stored row (``"copy"``).

    With ``raw`` (a :class:`ckpt_tool.ops._torch_free_source.TorchFreeSource` over the same reader) the
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
        # target tensors read whole (a replicated one read by several ranks counts once)
        self.tensors_done = 0
        self._left = {k: math.prod(t.shape) for k, t in target.tensors.items()}

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
        left = self._left.get(key)
        if left is not None:
            left -= math.prod(sizes)
            self._left[key] = left
            if left <= 0:
                del self._left[key]
                self.tensors_done += 1
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


def reshard_source(reader: Reader, target: CheckpointMeta, fill: str, to: str) -> PaddedSource:
    """The source a reshard's writer pulls from: torch-free numpy pieces
    (:class:`ckpt_tool.ops._torch_free_source.TorchFreeSource`) for a target whose writer takes
    them (``Writer.takes_raw_bytes``: torch_dist) when every target tensor is a source tensor
    of the same dtype whose chunks are plain items and whose dtype our archive writer takes,
    and a re-padded vocabulary copies rows; else torch tensors."""
    from ckpt_tool.formats.containers.torch_zip.torch_zip_write import STORAGE_TYPES
    from ckpt_tool.ops._torch_free_source import TorchFreeSource, torch_free_source_applies

    src = reader.metadata().tensors
    key_map = {k: k for k in target.tensors}
    raw = (writer_for(to).takes_raw_bytes
           and all(k in src and src[k].dtype == t.dtype and t.dtype in STORAGE_TYPES
                   for k, t in target.tensors.items())
           and torch_free_source_applies(reader, key_map, {}))
    source = PaddedSource(reader, target, fill=fill)
    if raw and (fill == "copy" or not source.rows):
        source = PaddedSource(reader, target, fill=fill, raw=TorchFreeSource(reader, key_map, {}))
    return source

