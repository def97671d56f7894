"""The files a training framework keeps beside its dist checkpoint, carried into what ``reshard``
and ``convert`` write in the source's container (docs/resume.md), saying what the output holds.

- **Megatron-Bridge** (0.3): its ``load_checkpoint`` finds the iteration through
  ``<save>/latest_train_state.pt`` (else Megatron-LM's tracker file), reads
  ``iter_N/run_config.yaml`` (``model.tensor_model_parallel_size`` /
  ``pipeline_model_parallel_size`` against the run's: on a mismatch it skips RNG and rerun
  state and needs a fully reshardable optimizer state; ``checkpoint.save_rng`` /
  ``save_optim``: whether to load them; without the file it falls back to Megatron-LM's
  ``args``, which Bridge does not save) and ``iter_N/train_state.pt`` (step, consumed samples:
  without it the data would start over). Carried: ``run_config.yaml`` with the new sizes and
  flags, ``train_state.pt`` (its zip CRCs checked), the same as ``latest_train_state.pt`` in a
  save directory (as Bridge writes it), the ``tokenizer/`` assets as they are.
- **NeMo 2**: ``<checkpoint>/context/`` (``io.json``, ``model.yaml``, the tokenizer's
  artifacts). NeMo's resume (``AutoResume``) takes the parallel sizes from the trainer it is
  given and reads only the tokenizer from the context; ``io.json``'s strategy sizes are
  updated all the same, so that the context describes the checkpoint (``nemo_io_for``).

- **Megatron-LM** (main, after 0.19): the ``tokenizer/`` assets its ``save_tokenizer_assets``
  writes into a torch_dist iteration directory (``formats/mcore_dist/tokenizer_assets.py``),
  copied into the output checkpoint's directory when that is a dist checkpoint, and beside
  ``config.json`` by ``convert --to hf`` when they are an HF tokenizer's files
  (:func:`carry_tokenizer_to_hf`). The output's manifest (``integrity.json``) records their
  sizes and digests; each copy is checked against the source file's size.

Anything else the source's checkpoint directory holds that depends on the data-parallel or
model-parallel layout (per-rank dataloader states, ModelOpt state) is left out, with a note.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ckpt_tool.errors import InputError
from ckpt_tool.formats.mcore_dist.tokenizer_assets import (TOKENIZER_DIR, is_hf_tokenizer,
                                                           tokenizer_assets)
from ckpt_tool.formats.mcore_dist.training_config import (bridge_run_config_for, load_json,
                                                          load_yaml, nemo_io_for)
from ckpt_tool.formats.save_dir import (BRIDGE_RUN_CONFIG, NEMO_CONTEXT, Container,
                                        SourcePlace)

__all__ = ["carry_framework_files", "carry_tokenizer_to_hf", "BRIDGE_TRAIN_STATE",
           "BRIDGE_LATEST_TRAIN_STATE"]

BRIDGE_TRAIN_STATE = "train_state.pt"
BRIDGE_LATEST_TRAIN_STATE = "latest_train_state.pt"
# a dist checkpoint's own files (what the writer made anew)
_CHECKPOINT_FILES = {"metadata.json", ".metadata", "common.pt", "integrity.json"}


def carry_framework_files(source: SourcePlace, staging: Path, container: Container,
                          layout: dict[str, Any] | None, has_rng: bool,
                          has_optimizer: bool) -> list[str]:
    """Write the framework's files of ``source`` into the container being staged at
    ``staging`` (rank 0 only); ``layout``: the target's ``Layout.to_dict()`` (None: unchanged).
    Returns notes for people."""
    if container.kind == "nemo" and source.container.kind == "nemo":
        return _carry_nemo(source.given, staging, layout)
    if container.framework == "megatron_bridge" and \
            source.container.framework == "megatron_bridge":
        return _carry_bridge(source.checkpoint, staging, container, layout, has_rng,
                             has_optimizer)
    where = container.checkpoint_in(staging)
    if (where / "metadata.json").is_file():  # a dist checkpoint: as Megatron-LM keeps them
        return _carry_tokenizer(source.checkpoint, where / TOKENIZER_DIR, "")
    return []


def carry_tokenizer_to_hf(checkpoint: Path, hf_dir: Path) -> list[str]:
    """Copy the HF tokenizer files Megatron-LM kept in ``checkpoint/tokenizer/`` beside the
    ``config.json`` in ``hf_dir``; notes for people (what was copied, or why not)."""
    assets = tokenizer_assets(checkpoint)
    if not assets:
        return []
    names = [n for n, _ in assets]
    if not is_hf_tokenizer(names):
        return [f"left out {TOKENIZER_DIR}/ ({', '.join(names[:4])}): not an HF tokenizer's "
                "files (no tokenizer_config.json); HF's AutoTokenizer would not load them"]
    taken = [n for n in names if "/" not in n and (hf_dir / n).exists()]
    if taken:
        return [f"left out {TOKENIZER_DIR}/: {', '.join(taken)} would replace the converted "
                "model's own file"]
    return _carry_tokenizer(checkpoint, hf_dir, "beside config.json ")


def _carry_tokenizer(checkpoint: Path, dest: Path, where: str) -> list[str]:
    assets = tokenizer_assets(checkpoint)
    if not assets:
        return []
    src = checkpoint / TOKENIZER_DIR
    for name, size in assets:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, target)
        if target.stat().st_size != size:
            raise InputError(f"{TOKENIZER_DIR}/{name} changed while it was copied "
                             f"({size} bytes, then {target.stat().st_size})", path=checkpoint,
                             hint="rerun once nothing writes the source")
    shown = ", ".join(n for n, _ in assets[:4]) + (", ..." if len(assets) > 4 else "")
    return [f"carried the {TOKENIZER_DIR}/ assets {where}({len(assets)} files: {shown})"]


def _carry_bridge(src: Path, staging: Path, container: Container,
                  layout: dict[str, Any] | None, has_rng: bool, has_optimizer: bool) -> list[str]:
    where = container.checkpoint_in(staging)
    config, changed = bridge_run_config_for(load_yaml(src / BRIDGE_RUN_CONFIG), layout,
                                            has_rng, has_optimizer)
    _write_yaml(where / BRIDGE_RUN_CONFIG, config)
    notes = [f"Megatron-Bridge's {BRIDGE_RUN_CONFIG} carried"
             + (f" ({', '.join(changed)})" if changed else "")]
    if (src / BRIDGE_TRAIN_STATE).is_file():
        state = _checked_torch_file(src / BRIDGE_TRAIN_STATE)
        (where / BRIDGE_TRAIN_STATE).write_bytes(state)
        carried = [BRIDGE_TRAIN_STATE]
        if container.kind == "save_dir":  # Bridge's tracker: a copy of the iteration's
            (staging / BRIDGE_LATEST_TRAIN_STATE).write_bytes(state)
            carried.append(BRIDGE_LATEST_TRAIN_STATE)
        notes.append(f"carried {' and '.join(carried)} (step and consumed samples)")
    else:
        notes.append(f"no {BRIDGE_TRAIN_STATE} in the source: Megatron-Bridge rebuilds its "
                     "train state from the checkpoint's iteration (consumed samples start at 0)")
    notes += _carry_tokenizer(src, where / TOKENIZER_DIR, "")
    left = sorted(p.name for p in src.iterdir() if p.name not in _CHECKPOINT_FILES
                  and p.suffix != ".distcp" and p.name not in (
                      BRIDGE_RUN_CONFIG, BRIDGE_TRAIN_STATE, TOKENIZER_DIR))
    if left:
        notes.append(f"left out {', '.join(left)} from {src.name}/ (state of the old layout, "
                     "e.g. per-rank dataloader or ModelOpt state)")
    return notes


def _carry_nemo(top: Path, staging: Path, layout: dict[str, Any] | None) -> list[str]:
    from ckpt_tool.formats.regular_files import check_tree

    context = top / NEMO_CONTEXT
    check_tree(context)  # a FIFO or device there is refused, never read
    shutil.copytree(context, staging / NEMO_CONTEXT)
    notes = [f"NeMo's {NEMO_CONTEXT}/ carried"]
    if layout is not None and (context / "io.json").is_file():
        graph, changed = nemo_io_for(load_json(context / "io.json"), layout)
        if changed:
            text = json.dumps(graph, indent=2)
            (staging / NEMO_CONTEXT / "io.json").write_text(text, encoding="utf-8")
            notes[0] += f" (io.json: {', '.join(changed)})"
    left = sorted(p.name for p in top.iterdir() if p.name not in ("weights", NEMO_CONTEXT))
    if left:
        notes.append(f"left out {', '.join(left)} from {top.name}/")
    return notes


def _checked_torch_file(path: Path) -> bytes:
    """The bytes of a ``torch.save`` file, every zip record's CRC-32 checked (IntegrityError,
    exit 1, when one does not match; CorruptCheckpointError, exit 2, when it is no archive)."""
    from ckpt_tool.formats.containers.torch_zip.archive_check import check_archive

    data = path.read_bytes()
    check_archive(data, "torch.save file", path=path)
    return data


def _write_yaml(path: Path, config: Any) -> None:
    """As Megatron-Bridge's ``ConfigContainer.to_yaml`` writes it (``yaml.safe_dump``)."""
    import yaml

    path.write_text(yaml.safe_dump(config, default_flow_style=False), encoding="utf-8")
