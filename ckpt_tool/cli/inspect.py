"""``ckpt inspect PATH``: placeholder until the formats layer lands."""

from __future__ import annotations

from ckpt_tool.cli._errors import handle_errors
from ckpt_tool.cli._options import CheckpointPath, JsonFlag, TrustFlag
from ckpt_tool.errors import UnsupportedError


@handle_errors
def inspect(path: CheckpointPath, json_: JsonFlag = False, trust: TrustFlag = False) -> None:
    """Show a checkpoint's tensors, objects and common state (metadata only).

    Example: ckpt inspect fixtures/gpt_tp2_pp2_fp32/iter_0000001
    """
    raise UnsupportedError("not built yet")
