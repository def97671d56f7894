"""``ckpt diff A B``: compare two checkpoints of any formats (being built)."""

from __future__ import annotations

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import CheckpointPath
from ckpt_tool.errors import UnsupportedError


@handle_errors
def diff(a: CheckpointPath, b: CheckpointPath) -> None:
    """Compare two checkpoints of any formats."""
    raise UnsupportedError("'ckpt diff' is not built yet in this version")
