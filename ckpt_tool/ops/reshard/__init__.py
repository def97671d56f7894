"""``reshard``: a checkpoint ready to resume at another TP/PP/EP layout.

Call order: open the source (a legacy source is viewed with stacked layers for dist targets)
-> ``plan_reshard`` (pure: feasibility problems, target metadata, per-rank pieces) -> stop
here for ``check``/``dry_run`` or when a problem is an error -> write into a staging directory
(``torch_dist``: one chunk per target rank's shard, in that rank's ``__{rank}_0.distcp``;
``legacy``: per-rank ``model_optim_rng.pt``), in the source's container (a save directory
gives a save directory: ``ops._container``) -> validate -> rename into place -> the recipe to
resume from it (``ops._resume``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import Container, SourcePlace, locate_source
from ckpt_tool.formats.writer import WRITERS, WriteRequest, WriterOptions, writer_for
from ckpt_tool.formats.legacy.writer import updated_args, write_legacy_ranks
from ckpt_tool.formats.containers.torch_zip.torch_save_object import torch_free_pickle
from ckpt_tool.ops._container import (check_container_target, output_container,
                                      place_container, to_validate)
from ckpt_tool.ops._optim_unflatten import BucketLayoutHints, unflatten_bucketed_optimizer
from ckpt_tool.ops.reshard._io import reshard_source
from ckpt_tool.ops._framework_files import carry_framework_files
from ckpt_tool.ops._resume import ResumeRecipe, written_facts
from ckpt_tool.ops._resume_frameworks import recipe_for
from ckpt_tool.ops.validate import UNVERIFIED_NOTE, check_source
from ckpt_tool.ops._stacked_view import stacked_view
from ckpt_tool.ops.manifest_checks import check_source_manifest
from ckpt_tool.ops._output_staging import (check_output_target, output_estimate,
                                           staged_output_ranks, verify_output)
from ckpt_tool.parallel import JobProgress
from ckpt_tool.parallel import ranks as current_ranks
from ckpt_tool.model import FormatKind
from ckpt_tool.storage import as_path

__all__ = ["ReshardRequest", "ReshardResult", "reshard"]


@dataclass(frozen=True)
class ReshardRequest:
    """The target layout and how to get there (the CLI options of ``ckpt reshard``).
    ``tp``/``pp``/``ep`` left None keep the source's value."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    to: str | None = None
    rules: tuple[str, ...] = ()
    drop_optimizer: bool = False
    make_vocab_size_divisible_by: int | None = None
    vocab_size: int | None = None
    vocab_fill: str = "copy"
    local_spec: bool | None = None  # None: from args.transformer_impl ("local")
    ddp_bucket_size: int | None = None  # the source's DDP buckets (0: one); None: stored


@dataclass
class ReshardResult:
    """The plan's verdict and, when written, what was written, in which container, and how to
    resume from it (``--json`` is ``to_dict``)."""

    source: str
    source_format: str
    target: str | None
    format: str
    plan: dict[str, Any]
    written: bool = False
    nbytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    container: Container = field(default_factory=Container)
    resume: ResumeRecipe | None = None

    @property
    def ok(self) -> bool:
        return bool(self.plan.get("ok"))

    def to_dict(self) -> dict[str, Any]:
        plan = dict(self.plan)
        layouts = {"source_layout": plan.pop("source", None),
                   "target_layout": plan.pop("target", None)}
        return {"source": self.source, "source_format": self.source_format,
                "target": self.target, "format": self.format, "written": self.written,
                "nbytes": self.nbytes, "seconds": round(self.seconds, 3),
                "notes": self.notes, "container": self.container.to_dict(),
                "resume": None if self.resume is None else self.resume.to_dict(),
                **layouts, **plan}


def reshard(src: str | Path | SourcePlace, dst: str | Path | None, req: ReshardRequest, *,
            check: bool = False, dry_run: bool = False, trust: bool = False,
            overwrite: bool = False, verify: bool = True, progress: Any = None,
            workers: int = 1, verify_source: bool = True) -> ReshardResult:
    """Plan (always) and, unless ``check``/``dry_run``, write the resharded checkpoint.
    ``src``: a path (a save directory is read at its tracker's iteration) or
    ``formats.save_dir.locate_source``'s answer (``--iteration``). ``verify``: validate the
    output before it is moved into place (True: data files proven as written are not read
    back; ``"full"``: every byte read back; ``ops._output_staging.verify_output``); ``verify_source``: check every byte read against the
    CRC-32 its record carries and the source's manifest (IntegrityError, exit 1)."""
    from ckpt_tool.planning.layout import load_rules
    from ckpt_tool.planning.reshard import ReshardOptions, plan_reshard

    start = time.perf_counter()
    r = current_ranks()
    place = src if isinstance(src, SourcePlace) else locate_source(src)
    out = None
    if not (check or dry_run):
        if dst is None:
            raise UsageError("reshard needs an output path", hint="ckpt reshard SRC DST --tp N")
        out = check_output_target(dst, sources=(place.given,), overwrite=overwrite)
    base = open_checkpoint(place.checkpoint, trust=trust, verify=verify_source)
    check_source(base.metadata(), needs_common=True)
    if verify_source:
        check_source_manifest(as_path(place.given), as_path(base.metadata().root), r)
    src_format = base.metadata().format
    to = req.to or ("legacy" if base.metadata().kind.legacy_rank_files else "torch_dist")
    if to not in WRITERS or not writer_for(to).megatron_resume_target:
        raise UsageError(f"reshard writes torch_dist or legacy, not {to!r}",
                         hint="reshard, then 'ckpt convert' the result")
    writer_cls = writer_for(to)
    rank_files = FormatKind(to).legacy_rank_files  # else a dist checkpoint
    container = output_container(place.container, to, base.metadata().common.get("iteration"))
    if out is not None:
        check_container_target(out, container)
    view = stacked_view(base, to)  # a legacy source with Megatron-Core's stacked keys
    reader = view or base
    if not rank_files and not req.drop_optimizer:
        spec = None if req.local_spec is None else (
            "local" if req.local_spec else "transformer_engine")
        reader = unflatten_bucketed_optimizer(reader, load_rules(req.rules),
                                              BucketLayoutHints(req.ddp_bucket_size, spec))
    with reader:
        meta = _own_objects(reader.metadata(), reader.objects_in_common())
        common, torch_free = _source_common(reader)
        layout, target_origins = _target_layout(req, meta, common)
        options = ReshardOptions(target_format=to, drop_optimizer=req.drop_optimizer,
                                 make_vocab_size_divisible_by=req.make_vocab_size_divisible_by,
                                 vocab_size=req.vocab_size, vocab_fill=req.vocab_fill)
        plan = plan_reshard(meta, layout, load_rules(req.rules), options, common=common)
        result = ReshardResult(source=str(meta.root), source_format=src_format,
                               target=None if out is None else str(out), format=to,
                               plan=plan.to_dict(ranks=dry_run), container=container)
        result.plan["target"]["origins"] = target_origins
        result.notes = [f"dropped {k}" for k in plan.dropped] + (
            [] if verify_source else [UNVERIFIED_NOTE])
        if view is not None:
            result.notes += view.notes()
        local_spec, why = _norm_names(req, common)
        if rank_files:
            result.plan["target"]["norm_names"] = (
                f"{'local spec (input_layernorm.*)' if local_spec else 'Transformer-Engine'}"
                f" ({why})")
        if check or dry_run or not plan.ok:
            result.seconds = time.perf_counter() - start
            return result
        target = plan.target_meta
        source = reshard_source(reader, target, req.vocab_fill, to)
        job_progress = JobProgress(progress, r)

        def on_bytes(nbytes: int) -> None:
            job_progress.update(nbytes, source.tensors_done)

        if progress is not None:
            progress.start(target.total_bytes, len(target.tensors))
        new_common = _new_common(reader, common, plan, layout)
        if not rank_files:
            target = _dist_objects_only(target, new_common, result.notes)
        # the writer keeps the source's form of the common state (``formats.mcore_dist.forms``)
        wopts = WriterOptions(extra={"threads": max(1, workers), "source_extras": meta.extras})
        if torch_free and not (
                writer_cls.writes_torch_free(target, wopts, common_alone=True)
                and torch_free_pickle(new_common) is not None):
            # it will be torch.save'd: the common state as torch loads it
            new_common = _new_common(reader, reader.common(), plan, layout)
            if not rank_files:  # the same legacy state dropped again (target and notes: above)
                _dist_objects_only(target, new_common, [])
        with staged_output_ranks(out, r, overwrite=overwrite, notes=result.notes,
                                 need_bytes=output_estimate(target),
                                 inner=None if rank_files else container.inner) as staging:
            if rank_files:  # every rank writes its share of the rank files (own save dir)
                skipped = write_legacy_ranks(staging, plan, source, new_common, on_bytes,
                                             ranks=r if r.world > 1 else None,
                                             local_spec=local_spec,
                                             iteration_dir=container.iteration_dir)
                if skipped:
                    result.notes.append(
                        f"left out {len(skipped)} optimizer tensors (e.g. {skipped[0]}): "
                        "legacy optimizer files cannot be rebuilt (resume with "
                        "--no-load-optim)")
            else:
                request = WriteRequest(
                    meta=target, source=source, common=new_common,
                    objects=lambda unique_key: reader.read_object(unique_key),
                    raw_object=reader.object_item_torch_free,
                    progress=on_bytes, ranks=r if r.world > 1 else None,
                    source_description=f"ckpt reshard of {meta.root}")
                where = place_container(staging, container, r)
                result.notes += writer_cls(where, wopts).write(request)
            r.barrier()
            job_progress.catch_up(source.tensors_done)
            facts = written_facts(container.checkpoint_in(staging), out, container, src_format,
                                  layout=layout.to_dict(), source_layout=plan.source.to_dict())
            if r.is_main:
                result.notes += carry_framework_files(place, staging, container, facts.layout,
                                                      facts.has_rng, facts.has_optimizer)
            r.barrier()
            if verify:
                verify_output(to_validate(staging, container), trust=trust, what="resharded",
                              ranks=r, level=verify)
            result.resume = recipe_for(facts)
    result.written = True
    mine = job_progress.local
    result.nbytes = r.broadcast(sum(r.gather(mine) or [0])) if r.world > 1 else mine
    result.seconds = time.perf_counter() - start
    return result


def _own_objects(meta: Any, in_common: frozenset[str]) -> Any:
    """``meta`` without the stored objects that are the source's common state
    (``Reader.objects_in_common``: Megatron-Core 0.19's ``common_state``): the target gets the
    new common state, never the source's again."""
    if not in_common:
        return meta
    return replace(meta, objects=tuple(o for o in meta.objects if o.unique_key not in in_common))


def _source_common(reader: Any) -> tuple[dict[str, Any], bool]:
    """The source's common state and whether it was loaded without torch (where the reader
    can: a torch_dist ``common.pt`` holding plain values and dtypes, these as ``TorchRef``;
    used for planning, and written without torch when the target's writer can, else loaded
    again with torch)."""
    common = reader.common_torch_free_exact()
    return (reader.common(), False) if common is None else (common, True)


def _new_common(reader: Any, common: dict[str, Any], plan: Any, layout: Any) -> dict[str, Any]:
    """The target's common state: the source's with the new sizes in ``args`` (a source
    without ``args`` gets none: Megatron-Bridge and NeMo keep their configuration in their own
    files, and Bridge falls back to ``args`` alone when its ``run_config.yaml`` is missing)."""
    new_common = dict(common)
    if common.get("args") is not None:
        new_common["args"] = updated_args(common.get("args"),
                                          {**plan.args_updates, **_world_size(common, layout)})
    return reader.common_for_target(new_common, layout)  # (a ChainedOptimizer's entries)


def _norm_names(req: ReshardRequest, common: dict[str, Any]) -> tuple[bool, str]:
    """Legacy targets: name the norms as a local-spec model (True) or as Transformer-Engine
    layers, and why: the flag, else the source's ``args.transformer_impl``."""
    if req.local_spec is not None:
        return req.local_spec, "--local-spec" if req.local_spec else "--te-spec"
    impl = getattr(common.get("args"), "transformer_impl", None)
    return impl == "local", f"args.transformer_impl={impl!r}"


def _world_size(common: dict[str, Any], layout: Any) -> dict[str, Any]:
    """``world_size`` for the new tp/pp at the source's data (and context) parallel size, as
    Megatron-LM's initialisation derives it; nothing without args."""
    args = common.get("args")
    dp = getattr(args, "data_parallel_size", None)
    if dp is None:
        return {}
    cp = getattr(args, "context_parallel_size", None) or 1
    return {"world_size": int(dp) * int(cp) * layout.tp * layout.pp}


def _target_layout(req: ReshardRequest, meta: Any, common: Any) -> tuple[Any, dict[str, str]]:
    """The target layout: each of tp/pp/ep given, else the source's (with where it came
    from); a source size nothing tells must be given."""
    from ckpt_tool.planning.source_layout import source_layout_from, source_layout_origins
    from ckpt_tool.planning.sizes import Layout

    source = source_layout_from(meta, common)
    known = source_layout_origins(meta, common)
    sizes: dict[str, int] = {}
    origins: dict[str, str] = {}
    for name in ("tp", "pp", "ep"):
        given = getattr(req, name)
        if given is not None:
            sizes[name], origins[name] = given, f"--{name}"
        elif known[name] == "unknown":
            raise UsageError(f"the source's {name} size is unknown (no args in the common "
                             "state, nothing evident in the chunk grids)",
                             hint=f"pass --{name}")
        else:
            sizes[name] = getattr(source, name)
            origins[name] = f"source: {known[name]}"
    return Layout(tp=sizes["tp"], pp=sizes["pp"], ep=sizes["ep"], etp=req.etp, vpp=req.vpp,
                  first_stage_layers=req.first_stage_layers,
                  last_stage_layers=req.last_stage_layers), origins


_PER_RANK = re.compile(r"^[a-z_]+/mp_rank_[0-9_]+$")


def _dist_objects_only(target: Any, common: dict[str, Any], notes: list[str]) -> Any:
    """Legacy per-rank state (``rng_state/mp_rank_…``, per-rank optimizer objects) has no place
    in a dist checkpoint: drop it (the common ``opt_param_scheduler`` stays)."""
    rng = common.get("rng_state")
    if isinstance(rng, dict) and rng and all(str(k).startswith("mp_rank_") for k in rng):
        common.pop("rng_state")
        notes.append("dropped the legacy per-rank rng_state (train with --no-load-rng)")
    keep = tuple(o for o in target.objects if not _PER_RANK.match(o.unique_key))
    dropped = len(target.objects) - len(keep)
    if dropped:
        notes.append(f"dropped {dropped} legacy per-rank objects (rng state, optimizer)")
    return replace(target, objects=keep)
