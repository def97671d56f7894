"""Writer of Megatron-LM legacy checkpoints (``--ckpt-format torch``) at the source's layout.

Layout written (what Megatron-LM's ``save_checkpoint`` writes, docs/formats.md section 4)::

    latest_checkpointed_iteration.txt            # the iteration, or "release"
    iter_0000010/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt
        {"args", "checkpoint_version", "iteration", "model" (or "model0".."modelN"), ...}

There is one way to write legacy files: the reshard plan (``planning.plan_reshard``) at the
source's own layout, executed by :func:`write_legacy_ranks` (which ``ckpt reshard`` runs at the
target layout) — stage-local layer
numbers, TP shards by the layout rules, experts by ep, virtual-pipeline chunks. Keys may come
per layer (``decoder.layers.7.…``) or stacked as Megatron-Core dist checkpoints store them.

Changing TP/PP is ``ckpt reshard``'s job: ``--tp/--pp`` here must match the source's layout
(or give one for a source without a recorded layout). Optimizer state is not written: legacy
optimizer files (``distrib_optim.pt``, per-rank optimizer state dicts) depend on the training
job's buckets and parameter groups, which a format conversion cannot rebuild.
"""

from __future__ import annotations

import argparse
import re
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.legacy.layout import LOCAL_TO_DIST_NAMES
from ckpt_tool.formats.write_guard import torch_save_file
from ckpt_tool.formats.writer import WriteRequest, Writer
from ckpt_tool.model import is_optimizer_key
from ckpt_tool.planning.extra_state import (EXTRA_STATE, NONE, legacy_extra_states,
                                            legacy_layer_spec)

__all__ = ["LegacyWriter", "write_legacy_ranks", "as_namespace", "updated_args"]

_STACKED = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)([^0-9].*)$")


class LegacyWriter(Writer):
    """See the module docstring."""

    format_name = "legacy"
    supports_ranks = True
    takes_layout = makes_save_directory = megatron_resume_target = True

    def write(self, request: WriteRequest) -> list[str]:
        from ckpt_tool.planning.feasibility import ERROR
        from ckpt_tool.planning.source_layout import source_layout_from
        from ckpt_tool.planning.reshard import ReshardOptions, plan_reshard

        summary = self.options.extra.get("source_common_summary") or {}
        meta = replace(request.meta, common=summary or request.meta.common)
        layout = self._layout(source_layout_from(meta, request.common), summary)
        plan = plan_reshard(meta, layout, options=ReshardOptions(target_format="legacy",
                                                                 drop_optimizer=True),
                            common=request.common)
        errors = [p for p in plan.problems if p.severity == ERROR]
        if errors:
            raise UsageError(f"cannot write legacy files: {errors[0].reason}",
                             hint=errors[0].fix)
        write_legacy_ranks(self.directory, plan, request.source, request.common,
                           progress=request.progress, ranks=request.ranks,
                           local_spec=bool(self.options.extra.get("local_spec")),
                           iteration_dir=self.options.extra.get("iteration_dir"))
        kept = {o.unique_key for o in plan.target_meta.objects} if plan.target_meta else set()
        self.objects_written = sum(o.unique_key in kept for o in request.meta.objects)
        self.tensors_written = sum(k not in plan.dropped for k in request.meta.tensors)
        return _notes(plan, request)

    def _layout(self, source: Any, summary: dict[str, Any]) -> Any:
        par = summary.get("parallel") or {}
        recorded_tp, recorded_pp = par.get("tp"), par.get("pp")
        tp = self.options.tp or recorded_tp or source.tp
        pp = self.options.pp or recorded_pp or source.pp
        if (recorded_tp and tp != recorded_tp) or (recorded_pp and pp != recorded_pp):
            raise UsageError(
                f"--tp {tp} --pp {pp} differs from the source layout (tp {recorded_tp}, "
                f"pp {recorded_pp})",
                hint="convert keeps the layout; use 'ckpt reshard --to legacy' to change it")
        return replace(source, tp=int(tp), pp=int(pp))


def _notes(plan: Any, request: WriteRequest) -> list[str]:
    notes = []
    optimizer = [k for k in plan.dropped if k in request.meta.tensors]
    if optimizer:
        notes.append(f"dropped {len(optimizer)} optimizer tensors (e.g. {optimizer[0]}): legacy "
                     "optimizer files depend on the training job's buckets and parameter "
                     "groups (resume with --no-load-optim)")
    kept = {o.unique_key for o in plan.target_meta.objects} if plan.target_meta else set()
    dropped = [o.unique_key for o in request.meta.objects if o.unique_key not in kept]
    if dropped:
        notes.append(f"dropped {len(dropped)} object{'s' * (len(dropped) != 1)} (e.g. {dropped[0]}): per-rank state "
                     "that legacy files of this layout cannot hold")
    return notes


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


def write_legacy_ranks(directory: Path, plan: Any, source: Any,
                       common: dict[str, Any], progress: Any = None, ranks: Any = None,
                       local_spec: bool = False, iteration_dir: str | None = None) -> list[str]:
    """One ``model_optim_rng.pt`` per target rank, as Megatron-LM writes them, from ``plan``,
    in the save directory ``directory``: ``iteration_dir`` (default: ``iter_NNNNNNN`` of the
    common state's iteration, else ``release``) and the tracker file naming it.
    Under torchrun (``ranks``) each process writes its share of the rank files (balanced by
    the bytes they read) and rank 0 the tracker file. ``local_spec``: name the layer norms as
    a local-spec (``--transformer-impl local``) model holds them (``input_layernorm.*``,
    ``pre_mlp_layernorm.*``) instead of the fused Transformer-Engine names dist checkpoints
    use. Returns the optimizer keys left out: a legacy ``model`` holds parameters only, and
    legacy optimizer files depend on the training job's buckets and parameter groups."""

    import torch

    from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype
    from ckpt_tool.planning.sizes import LayerMap

    meta = plan.target_meta
    lm = LayerMap(plan.sizes.num_layers, plan.target)
    iteration = common.get("iteration")
    iter_dir = directory / (iteration_dir or (
        "release" if iteration is None else f"iter_{int(iteration):07d}"))
    iter_dir.mkdir(parents=True, exist_ok=True)
    args = updated_args(common.get("args"), plan.args_updates)
    if getattr(args, "swiglu", None) is None:  # the files say how linear_fc1 was split
        args.swiglu = bool(plan.sizes.gated_linear_unit)
    same_layout = all(getattr(plan.source, f) == getattr(plan.target, f)
                      for f in ("tp", "pp", "ep", "expert_tp", "vpp"))
    todo = plan.ranks
    if ranks is not None and ranks.world > 1:
        from ckpt_tool.parallel import split_by_bytes

        share = split_by_bytes([(i, max(1, rp.read_bytes())) for i, rp in enumerate(plan.ranks)],
                               ranks.world)[ranks.rank]
        todo = [plan.ranks[i] for i in share]
    skipped: set[str] = set()
    for rp in todo:
        chunks: dict[int | None, OrderedDict] = {}
        for tp in rp.tensors:
            if is_optimizer_key(tp.key):
                skipped.add(tp.key)
                continue
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
                name = _local_spec_name(name) if local_spec else _te_spec_name(name, tp.key,
                                                                              meta)
                chunks.setdefault(chunk, OrderedDict())[name] = value
        names = [n for sd in chunks.values() for n in sd]  # the names tell the layer spec
        spec = legacy_layer_spec(names, args)
        chunks = {c: _with_extra_states(sd, spec) for c, sd in chunks.items()}
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
        torch_save_file(state, path)
    if ranks is None or ranks.is_main:
        name = iter_dir.name
        tracker = "release" if name == "release" else str(int(name[5:]))
        (directory / "latest_checkpointed_iteration.txt").write_text(tracker)
    return sorted(skipped)


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


def _local_spec_name(key: str) -> str:
    """The fused TE norm names of a layer key as a local-spec model holds them."""
    for local, fused in LOCAL_TO_DIST_NAMES:
        if fused in key:
            return key.replace(fused, local, 1)
    return key


_FC1_NORM = "mlp.linear_fc1.layer_norm_"


def _te_spec_name(name: str, key: str, meta: Any) -> str:
    """A legacy entry ``name`` (of dist key ``key``) as a Transformer-Engine model holds it: a
    MoE layer's pre-MLP norm, which the local spec saves under the fused name
    ``mlp.linear_fc1.layer_norm_*`` (there is no ``linear_fc1`` beside the experts), is TE's
    separate ``pre_mlp_layernorm``."""
    layer, found, _leaf = key.partition(_FC1_NORM)
    if found and f"{layer}mlp.router.weight" in meta.tensors:
        return name.replace(_FC1_NORM, "pre_mlp_layernorm.", 1)
    return name


def _with_extra_states(sd: OrderedDict, spec: str) -> OrderedDict:
    """``sd`` with the ``<module>._extra_state`` entries Megatron-LM's legacy save writes, each
    after its module's last parameter (:func:`ckpt_tool.planning.extra_state.legacy_extra_states`:
    ``None`` for Megatron-Core's linears, Transformer Engine's empty ``uint8`` tensor)."""
    import torch

    kinds = legacy_extra_states(sd, spec)
    last = {name.rsplit(".", 1)[0]: i for i, name in enumerate(sd)}
    out: OrderedDict = OrderedDict()
    for i, (name, value) in enumerate(sd.items()):
        out[name] = value
        module = name.rsplit(".", 1)[0]
        if module in kinds and last[module] == i:
            out[f"{module}.{EXTRA_STATE}"] = _payload(kinds[module], torch)
    return out


def _payload(kind: str, torch: Any) -> Any:
    return None if kind == NONE else torch.empty(0, dtype=torch.uint8)
