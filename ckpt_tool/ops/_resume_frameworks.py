"""How to resume, in the framework's own words, from what ``reshard``/``convert`` wrote into a
Megatron-Bridge or NeMo 2 container (docs/resume.md).

- **Megatron-Bridge** (0.3) takes its configuration as a ``ConfigContainer``, overridden
  ``section.field=value`` (Hydra style) by its scripts: ``checkpoint.load`` (the save
  directory), ``checkpoint.ckpt_step`` (an iteration without ``latest_train_state.pt``), the
  model's parallel sizes (``model.tensor_model_parallel_size`` ...). The carried
  ``run_config.yaml`` says whether the output holds RNG and optimizer state
  (``checkpoint.save_rng`` / ``save_optim``), which Bridge's ``load_checkpoint`` follows.
- **NeMo 2** resumes through ``AutoResume`` (``resume.resume_from_path``: the checkpoint
  directory; its ``weights/`` is loaded) with the trainer's ``MegatronStrategy`` sizes
  (``trainer.strategy.tensor_model_parallel_size`` ...), as NeMo-Run recipe overrides;
  ``trainer.strategy.ckpt_load_optimizer=false`` without optimizer state. The strategy reads
  the DistributedOptimizer's form from the checkpoint's content metadata.
"""

from __future__ import annotations

import shlex
from typing import Any

from ckpt_tool.formats.save_dir import LATEST_FILE, NEMO_WEIGHTS
from ckpt_tool.model import FormatKind
from ckpt_tool.ops._resume import (ResumeFacts, ResumeRecipe, ranks_note,
                                   resume_recipe)

__all__ = ["recipe_for", "framework_recipe"]

# Layout.to_dict() name -> the model's / the strategy's field
_SIZES = (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"))
_MORE = (("first_stage_layers", "num_layers_in_first_pipeline_stage"),
         ("last_stage_layers", "num_layers_in_last_pipeline_stage"))


def recipe_for(facts: ResumeFacts) -> ResumeRecipe | None:
    """The recipe in the words of whoever trained into the output's container: Megatron-Bridge
    or NeMo 2 for a dist checkpoint in theirs, else Megatron-LM's (None: a format it does not
    resume from)."""
    if facts.container.framework != "megatron_lm" and FormatKind(facts.target_format).megatron_dist:
        return framework_recipe(facts)
    return resume_recipe(facts)


def framework_recipe(facts: ResumeFacts) -> ResumeRecipe:
    """The recipe for a Megatron-Bridge or NeMo 2 container."""
    bridge = facts.container.framework == "megatron_bridge"
    section = "model" if bridge else "trainer.strategy"
    overrides: list[str] = []
    notes: list[str] = []
    (_bridge_load if bridge else _nemo_load)(facts, overrides, notes)
    if facts.layout is not None:
        _sizes(facts.layout, facts.source_layout or {}, section, overrides, notes)
    if not facts.has_optimizer:
        if not bridge:
            overrides.append("trainer.strategy.ckpt_load_optimizer=false")
        notes.append("no optimizer state: Adam starts afresh"
                     + (" (run_config.yaml says checkpoint.save_optim: false)" if bridge else ""))
    if bridge and not facts.has_rng:
        notes.append("no RNG state (run_config.yaml says checkpoint.save_rng: false): "
                     "Megatron-Bridge seeds the RNGs from rng.seed")
    if facts.has_optimizer and facts.sharding == "fully_reshardable":
        notes.append("optimizer state fully_reshardable: loads at any layout; later saves "
                     "take the form the run's own configuration gives")
    elif facts.has_optimizer and facts.sharding in ("dp_reshardable", "dp_zero_gather_scatter"):
        notes.append(f"optimizer state {facts.sharding}: resume at the same tensor and "
                     "pipeline sizes ('ckpt reshard' changes them)")
    return ResumeRecipe([], notes, _dist_line(facts, bridge), framework=facts.container.framework,
                        overrides=overrides)


def _bridge_load(facts: ResumeFacts, overrides: list[str], notes: list[str]) -> None:
    c, top = facts.container, str(facts.target)
    if c.kind == "save_dir":
        overrides.append(f"checkpoint.load={top}")
    elif c.kind == "iteration_dir" and c.iteration:
        overrides += [f"checkpoint.load={top}", f"checkpoint.ckpt_step={c.iteration}"]
        notes.append(f"no latest_train_state.pt or {LATEST_FILE} (the source had none): "
                     f"checkpoint.ckpt_step picks {c.iteration_dir}")
    else:
        name = c.iteration_dir or (f"iter_{facts.iteration:07d}" if facts.iteration is not None
                                   else "iter_0000000")
        save = shlex.quote(top + "-save")
        notes.append(f"{top} is not in a save directory, and checkpoint.load wants one: mkdir "
                     f"{save} && mv {shlex.quote(top)} {save}/{name}; then "
                     f"checkpoint.load={save} checkpoint.ckpt_step={int(name[5:])}")


def _nemo_load(facts: ResumeFacts, overrides: list[str], notes: list[str]) -> None:
    overrides.append(f"resume.resume_from_path={facts.target}")
    notes.append("NeMo restores the step, the consumed samples and the learning-rate "
                 "scheduler from the checkpoint's Lightning state, carried as it was")


def _sizes(new: dict[str, Any], old: dict[str, Any], section: str, overrides: list[str],
           notes: list[str]) -> None:
    for key, name in _SIZES:
        overrides.append(f"{section}.{name}={new[key]}")
    if new.get("ep", 1) != 1 or old.get("ep", 1) != 1:
        overrides.append(f"{section}.expert_model_parallel_size={new['ep']}")
    if new.get("etp", new["tp"]) != new["tp"] or old.get("etp", old.get("tp")) != old.get("tp"):
        overrides.append(f"{section}.expert_tensor_parallel_size={new['etp']}")
    if (new.get("vpp") or 1) > 1:
        overrides.append(f"{section}.virtual_pipeline_model_parallel_size={new['vpp']}")
    elif (old.get("vpp") or 1) > 1:
        notes.append(f"the source had {old['vpp']} virtual pipeline stages per rank; the output "
                     f"holds no such split: set {section}.virtual_pipeline_model_parallel_size "
                     "(or null) for the new pipeline size")
    for key, name in _MORE:
        if new.get(key) is not None:
            overrides.append(f"{section}.{name}={new[key]}")
        elif old.get(key) is not None:
            overrides.append(f"{section}.{name}=null")
    notes.append(ranks_note(new))


def _dist_line(facts: ResumeFacts, bridge: bool) -> str:
    """For scripts calling ``dist_checkpointing.load`` themselves: NeMo's keys are the
    DDP-wrapped model chunk's (``module.``-prefixed), its optimizer's state dict is built from
    them."""
    where = repr(str(facts.container.checkpoint_in(facts.target)))
    if bridge:
        line = (f"d = {where}; md = dist_checkpointing.load_content_metadata(d); "
                "sd = {'model': model.sharded_state_dict(metadata=md)}; ")
        if facts.has_optimizer:
            line += ("sd['optimizer'] = optimizer.sharded_state_dict(sd, is_loading=True, "
                     "metadata=md); ")
        return line + "dist_checkpointing.load(sd, d)"
    assert facts.container.inner == NEMO_WEIGHTS
    line = (f"d = {where}; md = dist_checkpointing.load_content_metadata(d); "
            "sd = {'state_dict': ddp_model.sharded_state_dict(metadata=md)}; ")
    if facts.has_optimizer:
        line += ("sd['optimizer'] = [optimizer.sharded_state_dict(sd['state_dict'], "
                 "is_loading=True, metadata=md)]; ")
    return line + "dist_checkpointing.load(sd, d)"
