"""How to resume from what ``reshard``/``convert`` wrote: the Megatron-LM flags that follow
from the change, notes for what flags cannot say, and the line for scripts that call
``dist_checkpointing`` themselves (docs/resume.md).

What Megatron-LM 0.16.1's ``load_checkpoint`` does, which the recipe follows from:

* ``--load DIR`` reads ``DIR/latest_checkpointed_iteration.txt`` (without it: a warning and
  random weights), or ``DIR/iter_N`` with ``--ckpt-step N``;
* ``--ckpt-format`` picks the loader (``torch``: legacy rank files; ``torch_dist``: dist);
* the DistributedOptimizer's sharding type is read from the checkpoint's content metadata, so
  a ``fully_reshardable`` state needs no flag at another layout, a ``dp_reshardable`` one is
  refused at another TP/PP, and ``--ckpt-fully-parallel-load`` is refused with
  ``dp_zero_gather_scatter``;
* RNG and optimizer state the checkpoint lacks fail the load (the default
  ``--dist-ckpt-strictness assume_ok_unexpected`` reports missing keys) unless
  ``--no-load-rng`` / ``--no-load-optim`` (RNG states are skipped on their own when TP/PP
  changed; the scheduler state is loaded with the optimizer's).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpt_tool.formats.save_dir import LATEST_FILE, Container, iteration_dir_name
from ckpt_tool.model import FormatKind

__all__ = ["ResumeFacts", "ResumeRecipe", "resume_recipe", "resume_for", "written_facts",
           "FRAMEWORK_NAMES", "ranks_note"]


@dataclass(frozen=True)
class ResumeFacts:
    """What was written, as far as a resume depends on it. ``layout``/``source_layout``:
    ``Layout.to_dict()`` of the target and the source (None: the layout did not change)."""

    target: Path
    container: Container
    source_format: str
    target_format: str
    has_optimizer: bool
    has_rng: bool
    sharding: str | None = None  # the output's distrib_optim_sharding_type
    iteration: int | None = None  # the common state's
    layout: dict[str, Any] | None = None
    source_layout: dict[str, Any] | None = None


def resume_for(written: Path, target: Path, container: Container, source_format: str,
               target_format: str, **layouts: Any) -> ResumeRecipe | None:
    """The recipe for the checkpoint just written at ``written`` (None for a format
    Megatron-LM does not resume from); ``layouts``: ``layout``/``source_layout`` of
    :func:`written_facts`."""
    if not FormatKind(target_format).megatron:
        return None
    return resume_recipe(written_facts(written, target, container, source_format, **layouts))


def written_facts(written: Path, target: Path, container: Container, source_format: str, *,
                  layout: dict[str, Any] | None = None,
                  source_layout: dict[str, Any] | None = None) -> ResumeFacts:
    """The facts of the checkpoint just written at ``written`` (in its staging directory: read
    before the rename, by every rank), which becomes ``target`` in ``container``."""
    from ckpt_tool.formats.base import open_checkpoint
    from ckpt_tool.model import is_optimizer_key

    with open_checkpoint(written) as reader:
        meta = reader.metadata()
    legacy = meta.kind.legacy_rank_files
    # (legacy rank files keep each rank's own RNG state; a dist checkpoint's are the
    # ``rng_state/shard_*`` objects Megatron-LM asks for, not a legacy source's per-rank ones)
    rng = [o for o in meta.objects
           if o.key == "rng_state" and (legacy or "/shard_" in o.unique_key)]
    optimizer = [k for k in (*meta.tensors, *(o.key for o in meta.objects))
                 if is_optimizer_key(k) and not k.endswith("opt_param_scheduler")]
    return ResumeFacts(
        target=target, container=container, source_format=source_format,
        target_format=meta.format, has_optimizer=bool(optimizer), has_rng=bool(rng),
        sharding=(meta.extras.get("optimizer_sharding") or {}).get("type"),
        iteration=meta.common.get("iteration"), layout=layout, source_layout=source_layout)


#: What the recipe's ``overrides`` are, per framework that trained into the container.
FRAMEWORK_NAMES = {"megatron_bridge": "Megatron-Bridge (config overrides)",
                   "nemo2": "NeMo 2 (recipe overrides)"}


@dataclass(frozen=True)
class ResumeRecipe:
    """``megatron_lm``: the flags to give Megatron-LM (an argv list: ``--load DIR``, the new
    parallel sizes, ``--no-load-rng`` ...; empty for a Megatron-Bridge or NeMo 2 container);
    ``framework``: who trained into the container (``megatron_lm``, ``megatron_bridge``,
    ``nemo2``); ``overrides``: for Bridge and NeMo, the configuration overrides (``key=value``,
    Hydra / NeMo-Run style) to resume with; ``notes``: what they cannot say;
    ``dist_checkpointing``: the line for scripts that load with ``dist_checkpointing``."""

    megatron_lm: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dist_checkpointing: str | None = None
    framework: str = "megatron_lm"
    overrides: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"megatron_lm": self.megatron_lm, "notes": self.notes,
                "dist_checkpointing": self.dist_checkpointing, "framework": self.framework,
                "overrides": self.overrides}

    def lines(self) -> list[str]:
        """For people (stderr), last: how to resume."""
        out = [f"resume with Megatron-LM: {shlex.join(self.megatron_lm)}"] \
            if self.megatron_lm else []
        if self.framework in FRAMEWORK_NAMES:
            out.append(f"resume with {FRAMEWORK_NAMES[self.framework]}: "
                       f"{shlex.join(self.overrides)}")
        out += [f"  - {n}" for n in self.notes]
        if self.dist_checkpointing:
            out.append(f"resume with dist_checkpointing: {self.dist_checkpointing}")
        return out


def resume_recipe(facts: ResumeFacts) -> ResumeRecipe | None:
    """The Megatron-LM recipe for an output Megatron-LM resumes from (None for the other
    formats); ``ops._resume_frameworks.recipe_for`` speaks Megatron-Bridge's and NeMo's."""
    target = FormatKind(facts.target_format)
    if not target.megatron:
        return None
    flags: list[str] = []
    notes: list[str] = []
    _load(facts, flags, notes)
    if FormatKind(facts.source_format).megatron_ckpt_format != target.megatron_ckpt_format:
        flags += ["--ckpt-format", str(target.megatron_ckpt_format)]
    if facts.layout is not None:
        _layout(facts.layout, facts.source_layout or {}, flags, notes)
    if not facts.has_rng:
        flags.append("--no-load-rng")
    if not facts.has_optimizer:
        flags.append("--no-load-optim")
        notes.append("no optimizer state: Adam starts afresh and the learning-rate scheduler "
                     "from the flags (Megatron-LM loads its state with the optimizer's)")
    _sharding(facts, notes)
    if target.zarr_arrays:
        notes.append("Megatron-Core 0.16 and later cannot load zarr (0.15 and earlier, with "
                     "zarr installed, can): 'ckpt convert --to torch_dist' for them")
    return ResumeRecipe(flags, notes, _dist_line(facts))


def _load(facts: ResumeFacts, flags: list[str], notes: list[str]) -> None:
    """``--load`` (and ``--ckpt-step``) for the container, or how to make one."""
    c, top = facts.container, str(facts.target)
    if c.kind == "save_dir":
        flags += ["--load", top]
        if c.tracker == "release":
            notes.append("a release checkpoint: Megatron-LM starts it at iteration 0 without "
                         "its optimizer or RNG state (as with --finetune)")
    elif c.kind == "iteration_dir":
        tracker = "release" if c.iteration is None else str(c.iteration)
        write = f"echo {tracker} > {shlex.quote(top + '/' + LATEST_FILE)}"
        if c.iteration:  # (Megatron-LM takes --ckpt-step 0 for none)
            flags += ["--load", top, "--ckpt-step", tracker]
            notes.append(f"no {LATEST_FILE} (the source had none): --ckpt-step picks "
                         f"{c.iteration_dir}; or write one: {write}")
        else:
            notes.append(f"no {LATEST_FILE} (the source had none): write one, then --load "
                         f"{shlex.quote(top)}: {write}")
    else:
        name = iteration_dir_name("release" if facts.iteration is None else facts.iteration)
        tracker = "release" if facts.iteration is None else str(facts.iteration)
        save = shlex.quote(top + "-save")
        notes.append(f"{top} is a bare checkpoint (so was the source), and --load wants a "
                     f"training save directory: mkdir {save} && mv {shlex.quote(top)} "
                     f"{save}/{name} && echo {tracker} > {save}/{LATEST_FILE}; then --load "
                     f"{save}")


_SIZES = (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"))


def _layout(new: dict[str, Any], old: dict[str, Any], flags: list[str],
            notes: list[str]) -> None:
    """The parallel sizes of the target (tp and pp always: they define the job to launch)."""
    for key, flag in _SIZES:
        flags += [flag, str(new[key])]
    if new.get("ep", 1) != 1 or old.get("ep", 1) != 1:
        flags += ["--expert-model-parallel-size", str(new["ep"])]
    if new.get("etp", new["tp"]) != new["tp"] or old.get("etp", old.get("tp")) != old.get("tp"):
        flags += ["--expert-tensor-parallel-size", str(new["etp"])]
    if (new.get("vpp") or 1) > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(new["vpp"])]
    elif (old.get("vpp") or 1) > 1:
        notes.append(f"the source had {old['vpp']} virtual pipeline stages per rank; the output "
                     "holds no such split: choose --num-virtual-stages-per-pipeline-rank (or "
                     "none) for the new pipeline size")
    for key, flag in (("first_stage_layers", "--decoder-first-pipeline-num-layers"),
                      ("last_stage_layers", "--decoder-last-pipeline-num-layers")):
        if new.get(key) is not None:
            flags += [flag, str(new[key])]
        elif old.get(key) is not None:
            notes.append(f"leave out {flag}: the target splits the layers evenly")
    notes.append(ranks_note(new))


def ranks_note(new: dict[str, Any]) -> str:
    """How many ranks the layout ``new`` (``Layout.to_dict()``) runs on."""
    ranks, what = new["tp"] * new["pp"], "tp x pp"
    if new.get("ep", 1) > 1:  # the experts' data-parallel group divides the world too
        ranks, what = math.lcm(ranks, new["etp"] * new["ep"] * new["pp"]), what + ", etp x ep x pp"
    return f"ranks: a multiple of {ranks} ({what}); any data-parallel size"


def _sharding(facts: ResumeFacts, notes: list[str]) -> None:
    """What the output's DistributedOptimizer sharding type asks of the resume."""
    if not facts.has_optimizer or facts.sharding is None:
        return
    if facts.sharding == "dp_zero_gather_scatter":
        notes.append("optimizer state dp_zero_gather_scatter: resume without "
                     "--ckpt-fully-parallel-load (Megatron-LM refuses it for this form)")
    elif facts.sharding == "dp_reshardable":
        notes.append("optimizer state dp_reshardable: resume at the same tensor and pipeline "
                     "sizes ('ckpt reshard' changes them)")


def _dist_line(facts: ResumeFacts) -> str | None:
    """For scripts calling ``dist_checkpointing.load`` themselves."""
    if not FormatKind(facts.target_format).megatron_dist:
        return None
    where = repr(str(facts.container.checkpoint_in(facts.target)))
    line = (f"d = {where}; md = dist_checkpointing.load_content_metadata(d); "
            "sd = {'model': model.sharded_state_dict(metadata=md)}; ")
    if facts.has_optimizer:
        line += ("sd['optimizer'] = optimizer.sharded_state_dict(sd, is_loading=True, "
                 "metadata=md); ")
    return line + "dist_checkpointing.load(sd, d)"
