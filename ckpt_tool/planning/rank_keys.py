"""Where a checkpoint key lives in a Megatron-LM rank layout and what a rank file calls it:
its pipeline stage and model chunk, its expert number, and its stage-local name (the reshard
plan's helpers; pure, no I/O)."""

from __future__ import annotations

import re

from ckpt_tool.planning.layout import model_key
from ckpt_tool.planning.sizes import LayerMap

__all__ = ["EMBEDDING", "OUTPUT", "stage_of", "expert_of", "local_key_of"]

_LAYER = re.compile(r"((?:^|\.)layers\.)(\d+)(\.)")
_STACKED = re.compile(r"(?:^|\.)layers\.(?!\d)")
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
_LAST_STAGE = re.compile(r"(^|\.)(output_layer|final_layernorm|final_norm)\.")
_EXPERT_NUM = (re.compile(r"((?:^|\.)(?:local_experts|experts)\.)(\d+)(\.)"),
               re.compile(r"(linear_fc\d\.(?:weight|bias))(\d+)()$"))  # TE grouped: weight3


def stage_of(key: str, lm: LayerMap, pp: int) -> tuple[int, int, int] | None:
    """``(pp, vp, local layer)`` of a per-layer key, ``(pp, vp, -1)`` for a non-layer key
    (the embedding in the first model chunk of the first stage, the final norm and output
    layer in the last chunk of the last stage, as Megatron-LM saves them), None for a stacked
    key (every stage)."""
    mk = model_key(key)
    m = _LAYER.search(mk)
    if m is not None:
        return lm.locate(int(m.group(2)))
    if _STACKED.search(mk):
        return None
    if _LAST_STAGE.search(mk):
        return pp - 1, max(lm.vpp, 1) - 1, -1
    return 0, 0, -1


def expert_of(key: str) -> int | None:
    """The global expert number in a per-expert key, else None."""
    for rx in _EXPERT_NUM:
        m = rx.search(key)
        if m is not None:
            return int(m.group(2))
    return None


def local_key_of(key: str, local_layer: int, local_expert: int | None = None) -> str:
    """``key`` with stage-local layer (and ep-local expert) numbers, as legacy files name it."""
    if local_layer >= 0:
        key = _LAYER.sub(lambda m: f"{m.group(1)}{local_layer}{m.group(3)}", key, count=1)
    if local_expert is not None:
        for rx in _EXPERT_NUM:
            if rx.search(key):
                return rx.sub(lambda m: f"{m.group(1)}{local_expert}{m.group(3)}", key, count=1)
    return key
