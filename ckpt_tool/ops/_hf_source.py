"""A ``TensorSource`` that executes HF <-> Megatron-Core recipes (``planning.hf_plan``).

Writers ask for rectangles of target tensors; each part of the recipe that the rectangle
touches is computed from its source tensors (one decoder layer, or one whole untiled tensor)
and the requested region copied out. The last part computed is kept, so a writer pulling a
tensor in row slabs reads its sources once; a request for a whole untiled tensor gets the
computed tensor itself (no copy). Peak memory is about one layer's tensor. Rows of an untiled
tensor that is its source's rows as they are (``copy``; ``rows``: vocab padding cut or added)
are read from the source itself, never the whole: an embedding or output layer (1.85 GB in
DeepSeek-V3) costs one slab of rows.
"""

from __future__ import annotations

import threading
from typing import Any

from ckpt_tool.formats.base import Reader
from ckpt_tool.planning.hf_plan import Part, Recipe, Src

__all__ = ["HfSource", "apply_part"]


def _qkv_split(t: Any, p: Part) -> Any:
    g, q, hd = p.param("groups"), p.param("q_per_group"), p.param("head_dim")
    v = t.reshape(g, q + 2, hd, *t.shape[1:])
    part = p.param("part")
    sel = v[:, :q] if part == 0 else v[:, q + part - 1: q + part]
    return sel.reshape(-1, *t.shape[1:])


def _qkv_fuse(q: Any, k: Any, v: Any, p: Part) -> Any:
    import torch

    g, n, hd = p.param("groups"), p.param("q_per_group"), p.param("head_dim")
    rest = tuple(q.shape[1:])
    fused = torch.cat([q.reshape(g, n, hd, *rest), k.reshape(g, 1, hd, *rest),
                       v.reshape(g, 1, hd, *rest)], dim=1)
    return fused.reshape(-1, *rest)


def _rows(t: Any, rows: int) -> Any:
    import torch

    if t.shape[0] >= rows:
        return t[:rows]
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def _rope_rows(t: Any, p: Part) -> Any:
    """Rotary rows in halves ``[x0 .. x_{d/2-1} | x_{d/2} ..]`` (HF ``rope_interleave:
    false``) -> interleaved pairs ``x0, x_{d/2}, x1, ...`` (Megatron-Core's MLA), in each of
    ``blocks`` blocks of ``keep`` rows then ``rot`` rotary rows."""
    import torch

    blocks, keep, rot = p.param("blocks"), p.param("keep"), p.param("rot")
    v = t.reshape(blocks, keep + rot, *t.shape[1:])
    r = v[:, keep:]
    half = rot // 2
    inter = torch.stack([r[:, :half], r[:, half:]], dim=2).reshape(blocks, rot, *t.shape[1:])
    return torch.cat([v[:, :keep], inter], dim=1).reshape(t.shape)


def apply_part(p: Part, tensors: list[Any]) -> Any:
    """The value of part ``p`` from its source tensors (in ``p.sources`` order)."""
    import torch

    if p.op == "copy":
        return tensors[0]
    if p.op == "qkv_split":
        return _qkv_split(tensors[0], p)
    if p.op == "qkv_fuse":
        return _qkv_fuse(*tensors, p)
    if p.op == "t":
        return tensors[0].t()
    if p.op == "qkv_from_cat":
        x = tensors[0].t() if p.param("transpose") else tensors[0]
        kv = p.param("groups") * p.param("head_dim")
        q, k, v = torch.split(x, [x.shape[0] - 2 * kv, kv, kv], dim=0)
        return _qkv_fuse(q, k, v, p)
    if p.op == "qkv_to_cat":
        parts = [_qkv_split(tensors[0], Part((), "", (), (("part", i),) + p.params))
                 for i in range(3)]
        x = torch.cat(parts, dim=0)
        return x.t() if p.param("transpose") else x
    if p.op == "glu_split":
        return torch.chunk(tensors[0], 2, dim=0)[p.param("half")]
    if p.op == "glu_fuse":
        return torch.cat(tensors, dim=0)
    if p.op == "rows":
        return _rows(tensors[0], p.param("rows"))
    if p.op == "rope_rows":
        return _rope_rows(tensors[0], p)
    if p.op == "swap_last":
        return tensors[0].transpose(-1, -2)
    if p.op == "glu_deinterleave":  # [..., 2F] gate/up interleaved -> [gate | up] (then t)
        x = tensors[0]
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x.transpose(-1, -2) if p.param("t") else x
    if p.op == "glu_interleave":  # the inverse
        x = tensors[0].transpose(-1, -2) if p.param("t") else tensors[0]
        g, u = torch.chunk(x, 2, dim=-1)
        return torch.stack([g, u], dim=-1).reshape(x.shape)
    if p.op == "zeros_rows":  # a router without expert bias: a zero correction bias
        return torch.zeros(tensors[0].shape[0], dtype=torch.float32)
    raise ValueError(f"unknown transform {p.op!r}")


class HfSource:
    """``TensorSource`` over ``reader`` for ``recipes`` (target key -> Recipe)."""

    def __init__(self, reader: Reader, recipes: dict[str, Recipe]):
        self.reader = reader
        self.recipes = recipes
        self.largest_piece = 0
        self.tensors_done = 0
        self._per_key: dict[str, int] = {}
        self._cache: tuple[tuple[str, int], Any] | None = None
        self._lock = threading.Lock()

    def _read_src(self, s: Src) -> Any:
        if not s.index:
            return self.reader.read(s.key)
        t = self.reader.read(s.key, tuple(slice(i, i + 1) for i in s.index))
        return t.reshape(t.shape[len(s.index):])

    def _part(self, key: str, n: int, p: Part) -> Any:
        with self._lock:
            if self._cache is not None and self._cache[0] == (key, n):
                return self._cache[1]
            self._cache = None  # the previous part is freed before this one is computed
        value = apply_part(p, [self._read_src(s) for s in p.sources]).contiguous()
        with self._lock:
            self._cache = ((key, n), value)
        return value

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The rectangle ``offsets``/``sizes`` of target tensor ``key``."""
        import torch

        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        r = self.recipes[key]
        dtype = torch_dtype(r.dtype)
        if len(r.parts) == 1 and not r.parts[0].index and not any(offsets) \
                and tuple(sizes) == tuple(r.shape):  # the whole tensor: handed out, no copy
            value = self._part(key, 0, r.parts[0])
            if tuple(value.shape) != tuple(r.shape):
                raise ValueError(f"{key}: {list(value.shape)}, the plan says {list(r.shape)}")
            with self._lock:
                self._cache = None
            return self._count(key, r, value.to(dtype))
        rows = self._source_rows(r, offsets, sizes)
        if rows is not None:
            return self._count(key, r, rows.to(dtype))
        whole = _whole_part(r, offsets, sizes)
        if whole is not None:  # exactly one whole part (a layer's chunk): handed out, no copy
            n, p = whole
            value = self._part(key, n, p)
            if tuple(value.shape) != tuple(r.shape[len(p.index):]):
                raise ValueError(f"{key}: part {n} is {list(value.shape)}, the plan says "
                                 f"{list(r.shape[len(p.index):])}")
            with self._lock:
                self._cache = None  # nothing else of this part will be asked for
            return self._count(key, r, value.to(dtype).reshape(sizes))
        out = torch.empty(sizes, dtype=dtype)
        for n, p in enumerate(r.parts):
            lead = len(p.index)
            if any(not o <= i < o + s for i, o, s in zip(p.index, offsets, sizes)):
                continue
            value = self._part(key, n, p)
            if tuple(value.shape) != tuple(r.shape[lead:]):
                raise ValueError(f"{key}: part {n} is {list(value.shape)}, the plan says "
                                 f"{list(r.shape[lead:])}")
            src = tuple(slice(o, o + s) for o, s in zip(offsets[lead:], sizes[lead:]))
            dst = tuple(i - o for i, o in zip(p.index, offsets))
            out[dst] = value[src].to(out.dtype)
        return self._count(key, r, out)

    def _source_rows(self, r: Recipe, offsets: tuple[int, ...], sizes: tuple[int, ...]
                     ) -> Any:
        """Rows ``offsets[0]:+sizes[0]`` (all columns) of an untiled recipe whose value is
        its one source's rows (zero rows past the source's end: vocab padding), read from
        the source alone; None for any other recipe or rectangle."""
        import torch

        p = r.parts[0] if len(r.parts) == 1 else None
        if (p is None or p.index or p.op not in ("copy", "rows") or len(p.sources) != 1
                or p.sources[0].index or not sizes or any(offsets[1:])
                or tuple(sizes[1:]) != tuple(r.shape[1:])):
            return None
        src = self.reader.metadata().tensors.get(p.sources[0].key)
        if src is None or tuple(src.shape[1:]) != tuple(r.shape[1:]) or (
                p.op == "copy" and tuple(src.shape) != tuple(r.shape)):
            return None
        start, stop = offsets[0], min(offsets[0] + sizes[0], src.shape[0])
        got = (self.reader.read(src.key, (slice(start, stop),)) if stop > start else None)
        if got is not None and stop - start == sizes[0]:
            return got
        out = torch.zeros(sizes, dtype=got.dtype if got is not None else torch.float32)
        if got is not None:
            out[:stop - start] = got
        return out

    def _count(self, key: str, r: Recipe, out: Any) -> Any:
        n_bytes = out.numel() * out.element_size()
        with self._lock:
            self.largest_piece = max(self.largest_piece, n_bytes)
            got = self._per_key.get(key, 0) + n_bytes
            self._per_key[key] = got
            total = r and _nbytes(r)
            if got >= total > got - n_bytes:
                self.tensors_done += 1
        return out


def _whole_part(r: Recipe, offsets: tuple[int, ...], sizes: tuple[int, ...]
                ) -> tuple[int, Part] | None:
    """``(n, part)`` when the rectangle is exactly one indexed part of ``r``, whole."""
    for n, p in enumerate(r.parts):
        lead = len(p.index)
        if lead and tuple(offsets[:lead]) == tuple(p.index) and all(s == 1 for s in sizes[:lead]) \
                and not any(offsets[lead:]) and tuple(sizes[lead:]) == tuple(r.shape[lead:]):
            return n, p
    return None


def _nbytes(r: Recipe) -> int:
    import math

    from ckpt_tool.model import dtype_itemsize

    return math.prod(r.shape) * dtype_itemsize(r.dtype)
