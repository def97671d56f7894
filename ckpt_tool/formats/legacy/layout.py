"""Pure rules of the Megatron-LM legacy layout (no I/O, no torch): rank directory names, which
pipeline stage holds which global layers, and how each parameter is split across TP ranks.

See docs/formats.md sections 4 and 5. Keys are Megatron-Core module names (the model's own
``state_dict`` names, e.g. ``decoder.layers.3.input_layernorm.weight``).
"""

from __future__ import annotations

import re

from ckpt_tool.planning.sizes import rank_dir_name

__all__ = ["RANK_DIR_RE", "LAYER_RE", "parse_rank_dir", "rank_dir_name", "stage_layer_offsets",
           "virtual_layer_offset", "globalize_key", "split_rule", "COLUMN", "ROW", "VOCAB",
           "GLU", "REPLICATED", "is_model_key", "model_keys"]

RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER_RE = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)(\d+)(\..*)$")
_EXPERT_RE = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")

COLUMN, ROW, VOCAB, GLU, REPLICATED = "column", "row", "vocab", "glu", "replicated"


def parse_rank_dir(name: str, pp_size: int | None = None) -> tuple[int, int, int] | None:
    """``mp_rank_01_002`` -> ``(tp=1, pp=2, ep=0)``; ``mp_rank_01`` -> ``(1, 0, 0)``.

    Two 3-digit groups are ``pp`` then ``ep``; with one group it is ``pp`` when ``pp_size`` is
    not 1, else ``ep`` (Megatron-LM appends ``_{pp:03d}`` only for PP > 1).
    """
    m = RANK_DIR_RE.match(name)
    if m is None:
        return None
    tp = int(m.group(1))
    a, b = m.group(2), m.group(3)
    if a is None:
        return tp, 0, 0
    if b is not None:
        return tp, int(a), int(b)
    if pp_size == 1:
        return tp, 0, int(a)
    return tp, int(a), 0


def stage_layer_offsets(num_layers: int, pp_size: int, first: int | None = None,
                        last: int | None = None) -> list[int]:
    """Global index of each stage's local layer 0 (``decoder_first/last_pipeline_num_layers``
    honoured); raises ValueError when the layers do not split evenly."""
    from ckpt_tool.planning.sizes import stage_layer_counts

    counts = stage_layer_counts(num_layers, pp_size, first, last)
    return [sum(counts[:p]) for p in range(len(counts))]


def virtual_layer_offset(num_layers: int, pp_size: int, vpp_size: int, pp: int, vp: int) -> int:
    """Megatron-Core's ``get_transformer_layer_offset`` with a virtual pipeline (even split)."""
    per_virtual = num_layers // pp_size // vpp_size
    return vp * (num_layers // vpp_size) + pp * per_virtual


def globalize_key(key: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A stage-local key with global layer (and expert) numbers."""
    m = LAYER_RE.match(key)
    if m is not None:
        key = f"{m.group(1)}{int(m.group(2)) + layer_offset}{m.group(3)}"
    if expert_offset:
        e = _EXPERT_RE.match(key)
        if e is not None:
            key = f"{e.group(1)}{int(e.group(2)) + expert_offset}{e.group(3)}"
    return key


def split_rule(key: str, *, swiglu: bool) -> tuple[str, int | None]:
    """``(kind, dim)`` of a parameter across TP ranks (docs/formats.md section 5)."""
    if key.endswith(("embedding.word_embeddings.weight", "output_layer.weight")):
        return VOCAB, 0
    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return (GLU, 0) if swiglu else (COLUMN, 0)
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return COLUMN, 0
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ROW, 1
    return REPLICATED, None


def is_model_key(key: object) -> bool:
    """``model`` or a virtual-pipeline chunk ``model0``, ``model1``, ..."""
    return isinstance(key, str) and (key == "model" or (key.startswith("model")
                                                         and key[5:].isascii() and key[5:].isdigit()))


def model_keys(state: object) -> list[str]:
    """The model state dict keys of one rank file, in model-chunk order."""
    if not isinstance(state, dict):
        return []
    if "model" in state:
        return ["model"]
    return sorted((k for k in state if is_model_key(k)), key=lambda k: int(k[5:]))


# Megatron-Core's local-spec TransformerLayer saves its norms under the fused TE names
# (``sharded_state_dict_keys_map``), so dist checkpoints of local and TE models agree.
LOCAL_TO_DIST_NAMES = (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                  ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"))
