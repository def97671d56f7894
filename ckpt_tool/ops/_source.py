"""A ``TensorSource`` over a ``Reader``: what writers pull their bytes from.

It maps target keys back to source keys (``--rename``), casts floating tensors to the target
dtype and counts what it read, so the executor can report bytes and check the memory bound.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ckpt_tool.formats.base import Reader

__all__ = ["ReaderSource", "FLOAT_DTYPES"]

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass
class ReaderSource:
    """Pulls rectangles of target tensors from ``reader``.

    ``key_map``: target key -> source key. ``dtypes``: target key -> target dtype name (only
    for keys whose dtype changes). ``sizes``: target key -> its bytes, to count finished
    tensors (``tensors_done``). ``largest_piece``: the most bytes handed out in one call.
    """

    reader: Reader
    key_map: dict[str, str]
    dtypes: dict[str, str] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    pieces: int = 0
    largest_piece: int = 0
    tensors_done: int = 0
    _per_key: dict[str, int] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The rectangle ``offsets``/``sizes`` of target tensor ``key`` (contiguous, CPU)."""
        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        t = self.reader.read(self.key_map[key], slices if slices else None)
        if key in self.dtypes:
            t = t.to(torch_dtype(self.dtypes[key]))
        t = t.contiguous()
        n = t.numel() * t.element_size()
        with self._lock:  # writers with --workers > 1 pull from several threads
            self.bytes_read += n
            self.pieces += 1
            self.largest_piece = max(self.largest_piece, n)
            got = self._per_key.get(key, 0) + n
            self._per_key[key] = got
            if key in self.sizes and got >= self.sizes[key] and got - n < self.sizes[key]:
                self.tensors_done += 1
        return t
