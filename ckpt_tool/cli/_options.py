"""Options shared by several commands, as ``Annotated`` aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["CheckpointPath", "JsonFlag", "TrustFlag"]

CheckpointPath = Annotated[
    Path,
    typer.Argument(
        help="Checkpoint directory, an iter_* directory, a training save directory or a file.",
        show_default=False,
        readable=False,  # checked by the command: one clear line, not click's usage box
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
TrustFlag = Annotated[
    bool,
    typer.Option(
        "--trust",
        help="Unpickle without the allowlist (runs code from the checkpoint: only for files you trust).",
    ),
]
