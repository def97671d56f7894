"""What ``convert`` writes: the target ``CheckpointMeta`` planned from the source's (pure, no I/O).

``plan_convert`` applies ``--filter``/``--exclude`` (regexes searched in the source key),
``--rename OLD=NEW`` (prefix mapping, first match wins), ``--model-only`` (drops optimizer
state) and ``--dtype`` (floating tensors only) and picks the target chunk grid:

* chunked targets (``Writer.chunked``: ``torch_dist``, ``dcp``, ``zarr``) keep the source's
  chunk grid when it is a plain tiling of the tensor (replicas counted once), so each output
  chunk is one source chunk read once; otherwise (flattened optimizer state, unchunked
  sources) one chunk per tensor;
* any chunk of theirs larger than ``max_memory`` is split along its first axis;
* safetensors keeps that grid too (``Writer.keeps_source_grid``), though each tensor is stored
  whole: its writer pulls pieces no bigger than the largest of them, so memory follows the
  stored chunks, not the tensor (a stacked ``decoder.layers.*`` tensor grows with the layers;
  each layer's chunk does not);
* other single-file targets get one chunk per tensor (their writers stream slabs themselves).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ckpt_tool.errors import UsageError, plural
from ckpt_tool.formats.writer import WRITERS, Writer, writer_for
from ckpt_tool.model import (CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta, dtype_itemsize,
                             is_optimizer_key)

__all__ = ["ConvertOptions", "ConvertPlan", "plan_convert", "parse_rename", "split_rows", "DTYPE_ALIASES",
           "TARGETS", "left_behind"]

TARGETS = tuple(WRITERS)  # what --to names
DTYPE_ALIASES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16",
                 "float16": "float16", "half": "float16", "fp32": "float32",
                 "float32": "float32", "float": "float32"}
_FLOATS = {"float64", "float32", "float16", "bfloat16"}
_OPTIMIZER_COMMON = ("optimizer", "opt_param_scheduler", "optim")


@dataclass(frozen=True)
class ConvertOptions:
    """The knobs of ``ckpt convert`` that shape the target (see the module docstring)."""

    to: str
    dtype: str | None = None
    filter: str | None = None
    exclude: str | None = None
    rename: tuple[tuple[str, str], ...] = ()
    model_only: bool = False
    max_memory: int | None = None
    hf_config: str | None = None  # --hf-config: config.json for --to hf (or to override)
    hf_arch: str | None = None  # --hf-arch: the architecture rule to use
    local_spec: bool = False  # --local-spec: local layer spec norm names (default TE)
    hf_dtype: str | None = None  # --hf-dtype: bf16 | fp8 (block-scaled) for --to hf
    hf_experts: str | None = None  # --hf-experts: per-expert | fused (routed experts, --to hf)


@dataclass(frozen=True)
class ConvertPlan:
    """The target metadata, where each target key/object comes from, and what was left out."""

    target: CheckpointMeta
    key_map: dict[str, str]
    dtypes: dict[str, str]
    object_map: dict[str, str]
    dropped_common: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)


def parse_rename(specs: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``["decoder.=model.decoder."]`` -> ``(("decoder.", "model.decoder."),)``."""
    out = []
    for spec in specs:
        old, sep, new = spec.partition("=")
        if not sep or not old:
            raise UsageError(f"bad --rename {spec!r}", hint="use --rename OLD_PREFIX=NEW_PREFIX")
        out.append((old, new))
    return tuple(out)


def _rename(key: str, rename: tuple[tuple[str, str], ...]) -> str:
    for old, new in rename:
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _compile(pattern: str | None, option: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise UsageError(f"bad {option} regex {pattern!r}: {exc}") from None


def plan_convert(meta: CheckpointMeta, options: ConvertOptions,
                 objects_in_common: frozenset[str] = frozenset()) -> ConvertPlan:
    """The target ``CheckpointMeta`` and key maps for converting ``meta`` (pure).
    ``objects_in_common``: the source's stored objects that are pieces of its common state
    (``Reader.objects_in_common``): they travel in the common state, not as objects."""
    writer = writer_for(options.to)  # (UsageError for a name it does not know)
    dtype = None
    if options.dtype is not None:
        dtype = DTYPE_ALIASES.get(options.dtype.lower())
        if dtype is None:
            raise UsageError(f"unknown --dtype {options.dtype!r}", hint="use bf16, fp16 or fp32")
    keep = _compile(options.filter, "--filter")
    drop = _compile(options.exclude, "--exclude")

    def selected(key: str) -> bool:
        if options.model_only and is_optimizer_key(key):
            return False
        if keep is not None and not keep.search(key):
            return False
        return drop is None or not drop.search(key)

    tensors: dict[str, TensorMeta] = {}
    key_map: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    for key, t in meta.tensors.items():
        if not selected(key):
            continue
        new_key = _rename(key, options.rename)
        if new_key in key_map:
            raise UsageError(f"--rename maps both {key_map[new_key]!r} and {key!r} to "
                             f"{new_key!r}", hint="use prefixes that do not collide")
        new_dtype = dtype if dtype is not None and t.dtype in _FLOATS else t.dtype
        if new_dtype != t.dtype:
            dtypes[new_key] = new_dtype
        chunks = _target_chunks(t, writer, new_dtype, options.max_memory)
        tensors[new_key] = TensorMeta(key=new_key, dtype=new_dtype, shape=t.shape,
                                      chunks=chunks, origin=key)
        key_map[new_key] = key

    if meta.tensors and not tensors and (keep is not None or drop is not None
                                         or options.model_only):
        raise UsageError(f"--filter/--exclude/--model-only leave none of the "
                         f"{plural(len(meta.tensors), 'tensor')} (an output without tensors "
                         "restores nothing)",
                         hint="check the patterns against `ckpt inspect SRC` (regexes searched "
                              "in each key)")
    objects: list[ObjectMeta] = []
    object_map: dict[str, str] = {}
    for o in meta.objects:
        if o.unique_key in objects_in_common or not selected(o.key):
            continue
        new = replace(o, key=_rename(o.key, options.rename),
                      unique_key=_rename(o.unique_key, options.rename),
                      file=None, byte_offset=None, byte_length=None)
        objects.append(new)
        object_map[new.unique_key] = o.unique_key

    common = dict(meta.common)
    dropped_common: tuple[str, ...] = ()
    if options.model_only:
        dropped_common = tuple(k for k in _OPTIMIZER_COMMON if k in common)
        for k in dropped_common:
            common.pop(k)
    notes = []
    n_out = len(meta.tensors) - len(tensors)
    if n_out:
        notes.append(f"left out {n_out} of {plural(len(meta.tensors), 'tensor')} "
                     "(--filter/--exclude/"
                     "--model-only)")
    target = CheckpointMeta(format=options.to, root="", tensors=tensors,
                            objects=tuple(objects), common=common,
                            extras={"source_format": meta.format, "source_root": meta.root})
    return ConvertPlan(target=target, key_map=key_map, dtypes=dtypes, object_map=object_map,
                       dropped_common=dropped_common, notes=notes)


def _target_chunks(t: TensorMeta, writer: type[Writer], dtype: str, max_memory: int | None
                   ) -> tuple[ChunkRef, ...]:
    whole = (ChunkRef(offsets=(0,) * len(t.shape), sizes=tuple(t.shape)),)
    grid = whole
    if writer.keeps_source_grid and _is_plain_tiling(t):
        seen = set()
        grid = tuple(ChunkRef(offsets=c.offsets, sizes=c.sizes) for c in t.chunks
                     if not (c.offsets in seen or seen.add(c.offsets)))
    if max_memory is None or not writer.chunked:
        return grid
    return tuple(piece for c in grid for piece in split_rows(c, dtype, max_memory))


def _is_plain_tiling(t: TensorMeta) -> bool:
    """The chunks are rectangles in the logical shape that cover it exactly (replicas equal)."""
    if t.stored_shape is not None or not t.chunks or not t.shape:
        return False
    if any(c.layout == "flat" or len(c.offsets) != len(t.shape) for c in t.chunks):
        return False
    unique = {}
    for c in t.chunks:
        if unique.setdefault(c.offsets, c.sizes) != c.sizes:
            return False
    covered = sum(math.prod(s) for s in unique.values())
    in_bounds = all(o + s <= n for off, sz in unique.items() for o, s, n in zip(off, sz, t.shape))
    return in_bounds and covered == t.numel


def split_rows(c: ChunkRef, dtype: str, max_memory: int) -> list[ChunkRef]:
    nbytes = c.numel * dtype_itemsize(dtype)
    if not c.sizes or nbytes <= max_memory or c.sizes[0] <= 1:
        return [c]
    row = nbytes // c.sizes[0]
    step = max(1, max_memory // max(row, 1))
    out = []
    for start in range(0, c.sizes[0], step):
        n = min(step, c.sizes[0] - start)
        out.append(ChunkRef(offsets=(c.offsets[0] + start, *c.offsets[1:]),
                            sizes=(n, *c.sizes[1:])))
    return out


def left_behind(meta: CheckpointMeta, used: set[str], objects_kept: int,
                common_kept: Any) -> dict[str, int]:
    """What of the source a conversion does not carry over, counted by kind (kinds with
    none left out): ``used``: the source tensors the output holds; ``objects_kept``: how
    many of its stored objects it holds; ``common_kept``: the top-level common-state keys it
    holds (``all``: every one)."""
    left = [k for k in meta.tensors if k not in used]
    optimizer = sum(1 for k in left if is_optimizer_key(k))
    keys = list(meta.common.get("keys") or ())
    common = 0 if common_kept == "all" else sum(1 for k in keys if k not in common_kept)
    counts = {"model tensors": len(left) - optimizer, "optimizer tensors": optimizer,
              "objects": max(0, len(meta.objects) - objects_kept),
              "common-state fields": common}
    return {kind: n for kind, n in counts.items() if n}
