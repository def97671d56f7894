"""``convert``: rewrite a checkpoint in another format, streaming, into an atomic output.

Call order: open the source (a legacy source is seen as Megatron-Core saves that model for a
dist target: :mod:`ckpt_tool.ops._stacked_view`) -> ``plan_convert`` (pure: target keys,
dtypes, chunk grid) -> ``check_source`` (the source's metadata is sound, its manifest
matches) -> ``staged_output`` (a staging directory beside the target; inside it the source's
container for the formats Megatron-LM resumes from: ``ops._container``) -> the target format's
``Writer`` pulls chunk after chunk from a ``ReaderSource`` (every item's CRC-32s checked before
its bytes are used, unless ``verify_source=False``) -> ``validate`` of what was written (unless
``verify=False``) -> fsync and rename into place -> the recipe to resume from it
(``ops._resume``). The source is only read.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import Container, SourcePlace, locate_source
from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
from ckpt_tool.model import FormatKind, is_optimizer_key
from ckpt_tool.ops._container import (check_container_target, output_container,
                                      place_container, to_validate)
from ckpt_tool.ops.convert._plan import (TARGETS, ConvertOptions, ConvertPlan, left_behind,
                                         parse_rename, plan_convert)
from ckpt_tool.ops._torch_free_source import TorchFreeSource, torch_free_source_applies
from ckpt_tool.ops._framework_files import carry_framework_files
from ckpt_tool.ops._resume import ResumeRecipe, resume_for, written_facts
from ckpt_tool.ops._resume_frameworks import recipe_for
from ckpt_tool.ops._source import ReaderSource
from ckpt_tool.ops.validate import UNVERIFIED_NOTE, check_source
from ckpt_tool.ops._stacked_view import stacked_view
from ckpt_tool.ops.manifest_checks import check_source_manifest
from ckpt_tool.storage import as_path, is_remote
from ckpt_tool.ops._output_staging import (check_output_target, output_estimate,
                                           staged_output_ranks, verify_output)
from ckpt_tool.parallel import JobProgress
from ckpt_tool.parallel import ranks as current_ranks

__all__ = ["ConvertResult", "convert", "ConvertOptions", "ConvertPlan", "plan_convert",
           "parse_rename", "TARGETS", "Progress"]


class Progress(Protocol):
    """Progress sink of long operations (the CLI draws a bar on stderr with it)."""

    def start(self, total_bytes: int, total_tensors: int) -> None:
        """Called once, when the totals are known."""

    def update(self, nbytes: int, tensors_done: int) -> None:
        """``nbytes`` more bytes written; ``tensors_done`` tensors finished so far."""


@dataclass(frozen=True)
class ConvertResult:
    """What ``convert`` did, in which container, and how to resume from it (``--json`` is
    ``to_dict()``)."""

    source: str
    source_format: str
    target: str
    format: str
    tensors: int
    objects: int
    nbytes: int
    seconds: float
    verified: bool
    largest_piece: int
    notes: list[str] = field(default_factory=list)
    container: Container = field(default_factory=Container)
    resume: ResumeRecipe | None = None
    source_verified: bool = True
    # what of the source the output does not hold, by kind: {"optimizer tensors": 48, ...}
    left_behind: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "source_format": self.source_format,
                "target": self.target, "format": self.format, "tensors": self.tensors,
                "objects": self.objects, "nbytes": self.nbytes,
                "seconds": round(self.seconds, 3), "verified": self.verified,
                "source_verified": self.source_verified,
                "largest_piece": self.largest_piece, "notes": self.notes,
                "left_behind": self.left_behind, "container": self.container.to_dict(),
                "resume": None if self.resume is None else self.resume.to_dict()}


def convert(src: str | Path | SourcePlace, dst: str | Path, options: ConvertOptions, *,
            trust: bool = False, overwrite: bool = False, verify: bool = True,
            tp: int | None = None, pp: int | None = None, max_shard_size: int | None = None,
            progress: Progress | None = None, workers: int = 1,
            verify_source: bool = True, ep: int | None = None) -> ConvertResult:
    """Convert checkpoint ``src`` into ``dst`` in format ``options.to``; see the module doc.
    ``src``: a path or ``formats.save_dir.locate_source``'s answer (``--iteration``).
    ``verify``: validate the output before it is moved into place (True: data files
    proven as written are not read back; ``"full"``: every byte read back); ``verify_source``: check
    every byte read against the CRC-32 its record carries and the source's manifest
    (IntegrityError, exit 1, on a mismatch: nothing is written)."""
    start = time.perf_counter()
    place = src if isinstance(src, SourcePlace) else locate_source(src)
    writer_cls = writer_for(options.to)
    if options.hf_dtype is not None and not FormatKind(options.to).hf_directory:
        raise UsageError(f"--hf-dtype applies with --to hf, not --to {options.to}",
                         hint="use --dtype to cast the tensors of other formats")
    if options.hf_experts is not None and not FormatKind(options.to).hf_directory:
        raise UsageError(f"--hf-experts applies with --to hf, not --to {options.to}",
                         hint="imports read either expert layout")
    if FormatKind(options.to).hf_directory or writer_cls.megatron_resume_target:
        from ckpt_tool.formats.base import detect
        from ckpt_tool.ops.convert._hf import convert_hf, is_hf_conversion

        if is_hf_conversion(detect(place.checkpoint).name, options.to):
            check_output_target(dst, sources=(place.given,), overwrite=overwrite)
            done = ConvertResult(**convert_hf(
                place.checkpoint, dst, options, trust=trust, overwrite=overwrite,
                verify=verify, tp=tp, pp=pp, max_shard_size=max_shard_size,
                progress=progress, verify_source=verify_source, ep=ep))
            return _with_resume_of_import(done)
    if ep is not None:
        raise UsageError("--ep only applies to an import from an HF directory",
                         hint="use 'ckpt reshard --ep N' to change the expert-parallel layout")
    if (tp is not None or pp is not None) and not writer_cls.takes_layout:
        raise UsageError("--tp/--pp only apply with --to legacy",
                         hint="use 'ckpt reshard' to change the parallel layout")
    r = current_ranks()
    out = check_output_target(dst, sources=(place.given,), overwrite=overwrite)
    reader = open_checkpoint(place.checkpoint, trust=trust, verify=verify_source)
    view = stacked_view(reader, options.to)  # legacy -> dist: Megatron-Core's stacked keys
    reader = view or reader
    with reader:
        meta = reader.metadata()
        container = output_container(place.container, options.to, meta.common.get("iteration"))
        check_container_target(out, container)
        file_name = out.name if out.suffix.lower() in writer_cls.file_suffixes else None
        one_file_model = (file_name and writer_cls.optimizer_beside and not options.model_only
                          and any(is_optimizer_key(k) for k in meta.tensors))
        if one_file_model:  # one .safetensors file is the model: its optimizer has no place
            options = dataclasses.replace(options, model_only=True)
        plan = plan_convert(meta, options, reader.objects_in_common())
        check_source(meta, plan.key_map.values(), needs_common=writer_cls.keeps_common == "full")
        if verify_source:
            check_source_manifest(as_path(place.given), as_path(meta.root), r)
        if one_file_model:
            plan.notes.append(f"{out.name} holds the model's weights only: optimizer state "
                              "left out (give a directory as DST to keep it in "
                              "optimizer.safetensors)")
        if file_name and writer_cls.shards_by_size:  # one file, as DST names it
            if max_shard_size:
                raise UsageError(f"{out.name} names one safetensors file, and --max-shard-size "
                                 "asks for shards", hint="give a directory as DST for shards")
            max_shard_size = max(plan.target.total_bytes, 1)
        sizes = {k: t.nbytes for k, t in plan.target.tensors.items()}
        raw = writer_cls.takes_raw_bytes and torch_free_source_applies(reader, plan.key_map,
                                                                       plan.dtypes)
        source: Any = (TorchFreeSource(reader, plan.key_map, sizes) if raw else
                       ReaderSource(reader, plan.key_map, plan.dtypes, sizes=sizes))
        notes = list(plan.notes) + (view.notes() if view is not None else []) + (
            [] if verify_source else [UNVERIFIED_NOTE])
        if progress is not None:
            progress.start(plan.target.total_bytes, len(plan.target.tensors))
        job_progress = JobProgress(progress, r)

        def on_bytes(nbytes: int) -> None:
            job_progress.update(nbytes, source.tensors_done)

        # torch_dist -> torch_dist (or dcp) moving raw bytes: common.pt and the objects' bytes
        # items may be copied (or re-pickled) as stored: the writer then never imports torch
        passthrough = (_passthrough(reader, plan) if raw and writer_cls.takes_stored_bytes
                       else {})
        # safetensors keeps only scalars of the common state: the summary has them (and
        # loading the full common state would import torch for nothing)
        scalars = writer_cls.keeps_common == "scalars"
        if scalars:  # (from the metadata's summary: checked here)
            reader.check_common()
        common = (_scalar_summary(meta.common) if scalars
                  else {} if passthrough else _full_common(reader, plan))
        request = WriteRequest(
            meta=plan.target, source=source, common=common,
            objects=lambda unique_key: reader.read_object(plan.object_map[unique_key]),
            **passthrough,
            progress=on_bytes, ranks=r if r.world > 1 else None,
            source_description=f"ckpt convert from {meta.format} checkpoint {meta.root}")
        wopts = WriterOptions(
            max_shard_size=max_shard_size or WriterOptions.max_shard_size,
            file_name=file_name, max_memory=options.max_memory, tp=tp, pp=pp,
            extra={"source_common_summary": meta.common, "source_extras": meta.extras,
                   "threads": max(1, workers), "iteration_dir": container.iteration_dir})
        own_dir = writer_cls.makes_save_directory
        with staged_output_ranks(out, r, overwrite=overwrite, file_name=file_name,
                                 notes=notes, need_bytes=output_estimate(plan.target),
                                 inner=None if own_dir else container.inner) as staging:
            where = staging if own_dir else place_container(staging, container, r)
            writer = writer_cls(where, wopts)
            if r.is_main or writer_cls.supports_ranks:
                notes += writer.write(request)
            r.barrier()
            job_progress.catch_up(source.tensors_done)
            facts = (written_facts(container.checkpoint_in(staging), out, container, meta.format)
                     if FormatKind(options.to).megatron else None)
            if facts is not None and r.is_main:
                notes += carry_framework_files(place, staging, container, None, facts.has_rng,
                                               facts.has_optimizer)
            r.barrier()
            if verify:
                single = file_name or writer_cls.default_file_name
                verify_output(staging / single if single else to_validate(staging, container),
                              trust=trust, what="converted", ranks=r,
                              level=verify)
            resume = None if facts is None else recipe_for(facts)
    tensors, objects = writer.written(plan.target)
    mine = job_progress.local
    left = _left_behind(meta, plan, writer_cls, tensors, objects, reader.objects_in_common())
    total = r.broadcast(sum(r.gather(mine) or [0])) if r.world > 1 else mine
    return ConvertResult(
        source=str(meta.root), source_format=meta.format, target=str(out), format=options.to,
        tensors=tensors, objects=objects, nbytes=total,
        seconds=time.perf_counter() - start, verified=bool(verify),
        largest_piece=source.largest_piece, notes=notes, container=container, resume=resume,
        source_verified=verify_source, left_behind=left)


def _left_behind(meta: Any, plan: ConvertPlan, writer_cls: Any, tensors: int, objects: int,
                 in_common: frozenset[str]) -> dict[str, int]:
    """What of the source the output does not hold: what the plan left out (--filter,
    --model-only, ...) and what the target format cannot hold (a writer that writes fewer
    tensors than planned leaves optimizer state out: a legacy model file)."""
    used = set(plan.key_map.values())
    unwritten = len(plan.target.tensors) - tensors
    if unwritten > 0:
        dropped = [plan.key_map[k] for k in plan.target.tensors
                   if is_optimizer_key(plan.key_map[k])][:unwritten]
        used -= set(dropped)
    keys = list(meta.common.get("keys") or ())
    if writer_cls.keeps_common == "full":
        kept: Any = [k for k in keys if k not in plan.dropped_common]
        objects += len(in_common & {o.unique_key for o in meta.objects})
    elif writer_cls.keeps_common == "scalars":
        kept = list(_scalar_summary(meta.common))
    else:
        kept = []
    return left_behind(meta, used, objects, kept)


def _with_resume_of_import(done: ConvertResult) -> ConvertResult:
    """An HF directory imported as a Megatron checkpoint, with its recipe (read from the
    output by rank 0, which prints it: the other ranks may not see the renamed output yet)."""
    kind = FormatKind(done.format)  # (torch_dist, legacy or hf: what an HF conversion writes)
    if not kind.megatron or not current_ranks().is_main \
            or (is_remote(done.target) and kind.legacy_rank_files):  # (not read from there)
        return done
    place = locate_source(done.target)
    return dataclasses.replace(done, container=place.container, resume=resume_for(
        place.checkpoint, as_path(done.target), place.container, done.source_format,
        done.format))


def _scalar_summary(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}


def _passthrough(reader: Any, plan: ConvertPlan) -> dict[str, Any]:
    """``WriteRequest`` pass-through fields for a source that keeps its common state and
    objects in torch_dist's own form (``{}`` when it does not)."""
    common_file = reader.common_file()
    if common_file is None or plan.dropped_common:
        return {}
    stored = reader.stored_object_bytes
    return {"common_file": common_file, "common_loader": lambda: _full_common(reader, plan),
            "raw_object": lambda unique_key: stored(plan.object_map[unique_key])}


def _full_common(reader: Any, plan: ConvertPlan) -> dict[str, Any]:
    common = dict(reader.common())
    for key in plan.dropped_common:
        common.pop(key, None)
    return common
