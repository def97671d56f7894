"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

__all__ = ["CheckpointPath", "SourcePath", "JsonFlag", "TrustFlag", "OverwriteFlag", "NoVerifyFlag",
           "VerifyOption", "verify_level", "SwigluOption",
           "MaxMemoryOption", "DebugFlag", "QuietFlag", "VerboseFlag", "NoProgressFlag",
           "IterationOption", "at_iteration", "source_place", "parse_size", "completer",
           "HfDtypeOption", "PlotOption"]

_WHERE = "Checkpoint directory, an iter_* directory, a training save directory or a file."
CheckpointPath = Annotated[
    Path,
    typer.Argument(
        metavar="PATH", help=_WHERE, show_default=False,
        readable=False,  # checked by the command: one clear line, not click's usage box
    ),
]
# The input of a command that writes (convert, reshard).
SourcePath = Annotated[Path, typer.Argument(metavar="SRC", help=_WHERE, show_default=False,
                                            readable=False)]
# convert --to hf: the weights' form (quantized or not)
HfDtypeOption = Annotated[Optional[str], typer.Option(
    "--hf-dtype", metavar="DTYPE", show_default=False,
    help="--to hf: bf16 (unquantized, floating tensors cast to bf16) or fp8 (the linear "
    "weights block-scaled float8_e4m3fn with 128x128 float32 scales, as FP8 releases store "
    "them). Default: the weights as the checkpoint stores them.")]
# diff: a picture of the per-layer similarity (needs matplotlib, the bench extra)
PlotOption = Annotated[Optional[Path], typer.Option(
    "--plot", metavar="FILE.png", show_default=False,
    help="Draw each layer's lowest cosine similarity between A and B into FILE.png "
    "(needs matplotlib: pip install 'ckpt[bench]').")]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
TrustFlag = Annotated[
    bool,
    typer.Option(
        "--trust",
        help="Unpickle without the allowlist (runs code from the checkpoint: only for files you trust).",
    ),
]



def _set_debug(value: bool) -> bool:
    if value:  # ``ckpt CMD ... --debug`` as well as ``ckpt --debug CMD ...``
        from ckpt_tool.cli._errors import state

        state.debug = True
    return value


def _set_quiet(value: bool) -> bool:
    if value:  # before the command body: every message it prints is already hushed
        from ckpt_tool.cli._output import hush

        hush()
    return value


def _supply_swiglu(value: Optional[bool]) -> Optional[bool]:
    from ckpt_tool.formats.legacy.metadata import supply_swiglu

    supply_swiglu(value)
    return value


SwigluOption = Annotated[Optional[bool], typer.Option(
    "--swiglu/--no-swiglu", callback=_supply_swiglu, show_default=False,
    help="Megatron-LM legacy checkpoints whose rank files lack args: whether linear_fc1 is a "
         "gated (SwiGLU) pair (decides how its TP shards merge; never guessed).")]
DebugFlag = Annotated[bool, typer.Option("--debug", callback=_set_debug,
                                         help="Show tracebacks on errors.")]
QuietFlag = Annotated[bool, typer.Option(
    "--quiet", "-q", callback=_set_quiet,
    help="Nothing on stderr but errors: no progress bar, no notes, and the last line only "
    "when the exit code is not 0.")]
VerboseFlag = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Also print what is only worth reading when something looks "
    "wrong (layouts, the whole feasibility table).")]
NoProgressFlag = Annotated[bool, typer.Option(
    "--no-progress", help="No progress bar (drawn on stderr only when it is a terminal).")]

IterationOption = Annotated[Optional[int], typer.Option(
    "--iteration", metavar="N", min=0, show_default=False,
    help="Training save directory: read iter_N (default: the one "
    "latest_checkpointed_iteration.txt names, else the latest).")]


def at_iteration(path: Path, iteration: int | None) -> Path:
    """What to read for ``path`` and ``--iteration``; says on stderr which iteration is read
    when a save directory has no tracker file."""
    from ckpt_tool.cli._output import message
    from ckpt_tool.formats.save_dir import select_iteration

    target, note = select_iteration(path, iteration)
    if note:
        message(f"note: {note}")
    return target


def source_place(path: Path, iteration: int | None) -> Any:
    """``at_iteration`` for the commands that write (convert, reshard): the source and its
    container (``formats.save_dir.locate_source``), which their output keeps."""
    from ckpt_tool.cli._output import message
    from ckpt_tool.formats.save_dir import locate_source

    place = locate_source(path, iteration)
    if place.note:
        message(f"note: {place.note}")
    return place


OverwriteFlag = Annotated[bool, typer.Option("--overwrite", help="Replace DST if it exists.")]
NoVerifyFlag = Annotated[bool, typer.Option(
    "--no-verify", help="Skip the integrity checks: every byte read against its CRC-32, and "
    "validating the output before it is moved into place (a note says so).")]
VerifyOption = Annotated[str, typer.Option(
    "--verify", metavar="LEVEL",
    help="How the output is checked before it is moved into place: 'written' (default: the "
    "bytes are proven as they are written, not read back) or 'full' (every byte read back "
    "from disk and checked against its CRC-32). docs/reliability.md says what each proves.")]


def verify_level(verify: str, no_verify: bool) -> bool | str:
    """The ``verify`` argument of the ops for ``--verify LEVEL`` / ``--no-verify``."""
    from ckpt_tool.errors import UsageError

    if verify not in ("written", "full"):
        raise UsageError(f"bad --verify {verify!r}", hint="use written or full")
    if no_verify:
        return False
    return "full" if verify == "full" else True


MaxMemoryOption = Annotated[Optional[str], typer.Option(
    "--max-memory", metavar="SIZE",
    help="Memory budget for tensor data, e.g. 2GiB (default: the largest "
    "tensor).", show_default=False)]

def completer(*choices: str):
    """Shell completion of an option's values: those of ``choices`` that start with what was
    typed. No choices: the target formats of ``convert`` (``formats.writer.WRITERS``)."""

    def complete(incomplete: str) -> list[str]:
        names = choices
        if not names:
            from ckpt_tool.formats.writer import WRITERS

            names = tuple(WRITERS)
        return [n for n in names if n.startswith(incomplete)]

    return complete


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str | None, option: str) -> int | None:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30; UsageError on anything else."""
    if text is None:
        return None
    import re

    from ckpt_tool.errors import UsageError

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"bad {option} value {text!r}", hint="use a size like 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
