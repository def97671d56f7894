"""Byte moving for ``reshard``: a stacked view of legacy checkpoints, a source that re-pads the
vocabulary, and the per-rank legacy files written from a ``ReshardPlan``.

Megatron-Core dist checkpoints store transformer layers stacked (``decoder.layers.<rest>`` with
the layer axis first); legacy files hold one key per layer (``decoder.layers.<n>.<rest>``).
``StackedView`` presents a legacy checkpoint the dist way (so its output loads into a
Megatron-Core model); ``write_legacy_ranks`` unstacks dist keys into per-layer legacy keys.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, TensorMeta

__all__ = ["StackedView", "PaddedSource", "write_legacy_ranks", "updated_args",
           "stacked_view_if_legacy"]

_PER_LAYER = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)(\d+)\.(.*)$")
_STACKED = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)([^0-9].*)$")


class StackedView(Reader):
    """A legacy reader's per-layer keys as Megatron-Core dist keys: a leading layer axis, and
    for routed experts (``…local_experts.<e>.…``) a second, global-expert axis under the
    name Megatron-Core's SequentialMLP saves (``…mlp.experts.experts.…``)."""

    format_name = "legacy"

    def __init__(self, reader: Reader):
        super().__init__(reader.path, trust=reader.trust)
        self.inner = reader
        self._meta: CheckpointMeta | None = None
        self._parts: dict[str, dict[tuple[int, ...], str]] = {}

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


# Megatron-Core's local-spec TransformerLayer saves its norms under the fused TE names
# (``sharded_state_dict_keys_map``), so dist checkpoints of local and TE models agree.
_LOCAL_TO_DIST = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                  ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))


def _dist_name(rest: str, *, moe: bool) -> str:
    for old, new in _LOCAL_TO_DIST:
        if rest.startswith(old) and not (moe and old.startswith("pre_mlp")):
            return new + rest[len(old):]
    return rest


def _local_spec_name(key: str) -> str:
    """The fused TE norm names of a layer key as a local-spec model holds them."""
    for local, fused in _LOCAL_TO_DIST:
        if fused in key:
            return key.replace(fused, local, 1)
    return key


class PaddedSource:
    """Reads target keys from ``reader``; rows of re-padded vocab tensors beyond the source's
    rows are zeros (``fill="zero"``) or copies of the last stored row (``"copy"``)."""

    def __init__(self, reader: Reader, target: CheckpointMeta, fill: str = "copy",
                 progress: Any = None):
        self.reader = reader
        self.fill = fill
        src = reader.metadata().tensors
        self.rows = {k: src[k].shape[0] for k, t in target.tensors.items()
                     if k in src and t.shape and src[k].shape and t.shape[0] != src[k].shape[0]}
        self.largest_piece = 0

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        import torch

        rows = self.rows.get(key)
        if rows is None or offsets[0] + sizes[0] <= rows:
            out = self._read(key, offsets, sizes)
        else:
            have = max(0, rows - offsets[0])
            parts = []
            if have:
                parts.append(self._read(key, offsets, (have, *sizes[1:])))
            extra = sizes[0] - have
            if self.fill == "zero":
                parts.append(self._read(key, (rows - 1, *offsets[1:]), (1, *sizes[1:]))
                             .mul(0).expand(extra, *sizes[1:]))
            else:
                parts.append(self._read(key, (rows - 1, *offsets[1:]), (1, *sizes[1:]))
                             .expand(extra, *sizes[1:]))
            out = torch.cat(parts)
        out = out.contiguous()
        self.largest_piece = max(self.largest_piece, out.numel() * out.element_size())
        return out

    def _read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        return self.reader.read(key, slices or None)


def as_namespace(args: Any) -> argparse.Namespace:
    """A fresh ``argparse.Namespace`` from a Namespace, a dict of its fields, or None."""
    if args is None:
        return argparse.Namespace()
    if isinstance(args, dict):
        return argparse.Namespace(**args)
    return argparse.Namespace(**vars(args))


def updated_args(args: Any, updates: dict[str, Any]) -> Any:
    """A copy of Megatron-LM's ``args`` Namespace with the new parallel sizes."""
    out = as_namespace(args)
    for k, v in updates.items():
        if v is not None or hasattr(out, k):
            setattr(out, k, v)
    return out


def write_legacy_ranks(directory: Path, plan: Any, source: PaddedSource,
                       common: dict[str, Any], progress: Any = None, ranks: Any = None,
                       local_spec: bool = False) -> None:
    """One ``model_optim_rng.pt`` per target rank, as Megatron-LM writes them, from ``plan``.
    Under torchrun (``ranks``) each process writes its share of the rank files (balanced by
    the bytes they read) and rank 0 the tracker file. ``local_spec``: name the layer norms as
    a local-spec (``--transformer-impl local``) model holds them (``input_layernorm.*``,
    ``pre_mlp_layernorm.*``) instead of the fused Transformer-Engine names dist checkpoints
    use."""
    import torch

    from ckpt_tool.formats._dcp_io import torch_dtype
    from ckpt_tool.planning.sizes import LayerMap

    meta = plan.target_meta
    lm = LayerMap(plan.sizes.num_layers, plan.target)
    iteration = common.get("iteration")
    iter_dir = directory / ("release" if iteration is None else f"iter_{int(iteration):07d}")
    iter_dir.mkdir(parents=True, exist_ok=True)
    args = updated_args(common.get("args"), plan.args_updates)
    same_layout = all(getattr(plan.source, f) == getattr(plan.target, f)
                      for f in ("tp", "pp", "ep", "expert_tp", "vpp"))
    todo = plan.ranks
    if ranks is not None and ranks.world > 1:
        from ckpt_tool.parallel import split_by_bytes

        share = split_by_bytes([(i, max(1, rp.read_bytes())) for i, rp in enumerate(plan.ranks)],
                               ranks.world)[ranks.rank]
        todo = [plan.ranks[i] for i in share]
    for rp in todo:
        chunks: dict[int | None, OrderedDict] = {}
        for tp in rp.tensors:
            dtype = torch_dtype(meta.tensors[tp.key].dtype)
            local = torch.empty(tp.local_shape, dtype=dtype)
            for pp_ in tp.pieces:
                pc = pp_.piece
                box = tuple(slice(o, o + s) for o, s in zip(pc.local_offsets, pc.sizes))
                if pc.fill:
                    row = (source.read(tp.key, (pc.fill_row, *pc.global_offsets[1:]),
                                       (1, *pc.sizes[1:])) if pc.fill != "zero" else None)
                    local[box] = 0 if row is None else row.expand(*pc.sizes)
                else:
                    data = source.read(tp.key, pc.global_offsets, pc.sizes)
                    local[box] = data
                    if progress is not None:
                        progress(data.numel() * data.element_size())
            for chunk, name, value in _legacy_entries(tp, local, lm, rp, plan):
                if local_spec:
                    name = _local_spec_name(name)
                chunks.setdefault(chunk, OrderedDict())[name] = value
        state: dict[str, Any] = {"args": args,
                                 "checkpoint_version": common.get("checkpoint_version", 3.0)}
        for k in ("iteration", "num_floating_point_operations_so_far", "opt_param_scheduler"):
            if k in common:
                state[k] = common[k]
        rng = common.get("rng_state")
        rank_dir = rp.file.split("/")[0]
        if same_layout and isinstance(rng, dict) and rank_dir in rng:
            state["rng_state"] = rng[rank_dir]  # the layout is kept: each rank its own state
        if set(chunks) <= {None}:
            state["model"] = chunks.get(None, OrderedDict())
        else:
            for vp, sd in sorted(chunks.items(), key=lambda kv: kv[0] or 0):
                state[f"model{vp or 0}"] = sd
        path = iter_dir / rp.file
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
    if ranks is None or ranks.is_main:
        tracker = "release" if iteration is None else str(int(iteration))
        (directory / "latest_checkpointed_iteration.txt").write_text(tracker)


def _legacy_entries(tp: Any, local: Any, lm: Any, rp: Any, plan: Any
                    ) -> list[tuple[int | None, str, Any]]:
    """``(virtual stage, name, tensor)`` for the legacy file: a stacked dist key's layer (and
    expert) slab becomes the per-layer key with its stage-local layer (and ep-local expert)
    number."""
    m = _STACKED.match(tp.local_key)
    if m is None:
        return [(tp.model_chunk, tp.local_key, local)]
    offsets = tp.pieces[0].piece.global_offsets
    _pp, vp, local_layer = lm.locate(offsets[0])
    rest = m.group(2)
    lead = 1
    e = _STACKED_EXPERT.match(rest)
    if e is not None:
        per = (plan.sizes.num_experts or 0) // max(plan.target.ep, 1)
        local_expert = offsets[1] - rp.ep * per
        rest, lead = f"{e.group(1)}local_experts.{local_expert}.{e.group(2)}", 2
    name = f"{m.group(1)}{local_layer}.{rest}"
    chunk = vp if (plan.target.vpp or 1) > 1 else None
    return [(chunk, name, local.reshape(local.shape[lead:]).clone())]


_STACKED_EXPERT = re.compile(r"^(.*\.experts\.)experts\.(.*)$")


def stacked_view_if_legacy(reader: Reader, target_format: str) -> Reader:
    """Legacy sources become stacked for dist targets (Megatron-Core's key layout)."""
    if reader.metadata().format == "legacy" and target_format != "legacy":
        return StackedView(reader)
    return reader

