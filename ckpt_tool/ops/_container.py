"""The container of what ``reshard`` and ``convert`` write: the source's (a training save
directory gives a save directory, an iteration directory an iteration directory, a NeMo 2
checkpoint directory a NeMo checkpoint directory, a bare checkpoint a bare one) for the formats
Megatron-LM resumes from, a bare checkpoint for the others (docs/resume.md). The framework's
files in it are carried by ``ops._framework_files``.

Megatron-LM's ``--load DIR`` reads ``DIR/latest_checkpointed_iteration.txt`` and loads the
iteration directory it names (or, with ``--ckpt-step N``, ``DIR/iter_N`` without the tracker
file). The formats it loads that way are the dist formats (``torch_dist``; ``zarr`` up to
Megatron-Core 0.15) and the legacy rank files, which only exist inside a save directory and
are always written as one. A DCP export is for ``torch.distributed.checkpoint.load`` (Megatron-LM's
``torch_dcp`` format is its FSDP2 state, other keys); safetensors, torch and HF outputs are
model files: these are written bare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.formats.save_dir import (LATEST_FILE, NEMO_WEIGHTS, Container,
                                        iteration_dir_name, is_iteration_dir_name)
from ckpt_tool.formats.writer import writer_for
from ckpt_tool.model import FormatKind

__all__ = ["output_container", "check_container_target", "place_container",
           "to_validate"]



def output_container(source: Container, to: str, iteration: Any = None) -> Container:
    """The container of an output in format ``to`` from a source in ``source``; ``iteration``
    (the common state's) names a legacy output's iteration directory when the source has
    none."""
    if writer_for(to).makes_save_directory:  # legacy rank files: always in a save directory
        name = source.iteration_dir or iteration_dir_name(
            "release" if iteration is None else int(iteration))
        return Container("save_dir", name)
    if FormatKind(to).megatron:  # what Megatron-LM resumes from: in the source's container
        return source
    return Container()


def check_container_target(out: Path, container: Container) -> None:
    """Refuse a DST named as an iteration directory when the output holds one inside it
    (``new/iter_0000010/iter_0000010/`` is never what was meant)."""
    if container.kind == "nemo" and out.name == NEMO_WEIGHTS:
        raise UsageError("the output is a NeMo checkpoint directory holding weights/, but DST "
                         "is named as its weights/ itself", path=out,
                         hint=f"give the checkpoint directory: {out.parent}")
    if container.iteration_dir and is_iteration_dir_name(out.name):
        raise UsageError(
            f"the output is a {container.kind.replace('_', ' ')} holding "
            f"{container.iteration_dir}/, but DST is named as an iteration directory itself",
            path=out, hint=f"give the directory to hold it: {out.parent}")


def place_container(staging: Path, container: Container, ranks: Any = None) -> Path:
    """Make the container in the staging directory (the iteration directory; the tracker file,
    written by rank 0) and return where the checkpoint goes."""
    where = container.checkpoint_in(staging)
    where.mkdir(parents=True, exist_ok=True)
    if container.tracker is not None and (ranks is None or ranks.is_main):
        (staging / LATEST_FILE).write_text(container.tracker)
    return where


def to_validate(staging: Path, container: Container) -> Path:
    """What validating the output means: a save directory through its tracker file, an
    iteration directory's or NeMo checkpoint directory's checkpoint, a bare checkpoint
    itself."""
    return container.checkpoint_in(staging) if container.kind in ("iteration_dir", "nemo") \
        else staging
