"""What a Megatron-Core model is built from, in the words ``inspect`` uses, read off the stored
keys and shapes alone (pure; metadata only).

Each entry of :data:`PARTS` names one architecture part by the keys that only it stores and says
what its shapes tell: Multi-Latent Attention (its LoRA ranks), attention sinks, routed experts
(how many, in which layers, shared experts and their gate, the router's expert bias), Multi-Token
Prediction (its depth), Mamba mixers and the hybrid layer pattern. A new family adds one entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ckpt_tool.model import CheckpointMeta, TensorMeta, is_optimizer_key

__all__ = ["PARTS", "Part", "model_parts", "layer_pattern"]

_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")

Tensors = Mapping[str, TensorMeta]


def _find(tensors: Tensors, suffix: str) -> TensorMeta | None:
    for k, t in tensors.items():
        if k.endswith(suffix):
            return t
    return None


def _rows(t: TensorMeta | None) -> int | None:
    return int(t.shape[-2]) if t is not None and len(t.shape) >= 2 else None


def _mla(tensors: Tensors) -> str | None:
    kv_down = _find(tensors, "self_attention.linear_kv_down_proj.weight")
    if kv_down is None:
        return None
    q_down = _find(tensors, "self_attention.linear_q_down_proj.weight")
    kv_norm = _find(tensors, "self_attention.kv_layernorm.weight") or _find(
        tensors, "self_attention.linear_kv_up_proj.layer_norm_weight")
    kv_rank = int(kv_norm.shape[-1]) if kv_norm is not None else None
    words = [f"q LoRA rank {_rows(q_down)}" if q_down is not None else "no q LoRA (linear_q_proj)"]
    if kv_rank is not None:
        words.append(f"kv LoRA rank {kv_rank}")
        rows = _rows(kv_down)
        if rows is not None and rows > kv_rank:
            words.append(f"rope head dim {rows - kv_rank}")
    return "Multi-Latent Attention (" + ", ".join(words) + ")"


def _sinks(tensors: Tensors) -> str | None:
    return "learnable softmax offsets (attention sinks)" if _find(
        tensors, "core_attention.softmax_offset") is not None else None


def _experts(tensors: Tensors) -> str | None:
    stacked = [k for k in tensors if re.search(r"experts\.(experts|local_experts)\.linear_fc1\."
                                               r"weight$", k) and "mtp." not in k]
    if not stacked:
        return None
    t = tensors[stacked[0]]
    count = int(t.shape[-3]) if len(t.shape) >= 3 else None
    moe_layers = sorted({int(m.group(1)) for k in stacked if (m := _LAYER.search(k))})
    dense_layers = sorted({int(m.group(1)) for k in tensors if (m := _LAYER.search(k))
                           and m.group(2).startswith("mlp.linear_fc1.")})
    words = [f"{count} routed experts" if count else "routed experts"]
    if moe_layers:
        words.append(f"MoE layers {_ranges(moe_layers)}")
    if dense_layers:
        words.append(f"dense layers {_ranges(dense_layers)}")
    if any(".shared_experts." in k for k in tensors):
        words.append("shared experts" + (" (gated)" if any(
            k.endswith("shared_experts.gate_weight") for k in tensors) else ""))
    if any(k.endswith("router.expert_bias") for k in tensors):
        words.append("router expert bias (aux-loss-free balancing)")
    return ", ".join(words)


def _mtp(tensors: Tensors) -> str | None:
    depth = {int(m.group(1)) for k in tensors if (m := _MTP.search(k))}
    return f"Multi-Token Prediction, depth {len(depth)}" if depth else None


def _mamba(tensors: Tensors) -> str | None:
    if not any(".mixer.in_proj." in k for k in tensors):
        return None
    pattern = layer_pattern(tensors)
    return "Mamba mixers" + (f", hybrid layer pattern {pattern}" if pattern else "")


@dataclass(frozen=True)
class Part:
    """One architecture part: its name in ``inspect`` and what the stored tensors say of it
    (None: the model has no such part)."""

    name: str
    describe: Callable[[Tensors], str | None]


PARTS: tuple[Part, ...] = (
    Part("attention", _mla),
    Part("attention sinks", _sinks),
    Part("experts", _experts),
    Part("mtp", _mtp),
    Part("mamba", _mamba),
)

#: a layer's kind in Megatron-Core's ``hybrid_override_pattern`` letters, by the keys it stores
_LAYER_LETTERS = (("mixer.", "M"), ("self_attention.", "*"), ("mlp.experts.", "E"),
                  ("mlp.linear_fc", "-"))


def layer_pattern(tensors: Tensors) -> str:
    """The per-layer pattern (``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE) of a model
    whose layers are stored one key per layer ("" otherwise)."""
    kinds: dict[int, str] = {}
    for k in tensors:
        m = _LAYER.search(k)
        if not m:
            continue
        for marker, letter in _LAYER_LETTERS:
            if m.group(2).startswith(marker):
                kinds.setdefault(int(m.group(1)), letter)
                break
    if not kinds or sorted(kinds) != list(range(len(kinds))):
        return ""
    return "".join(kinds[i] for i in range(len(kinds)))


def model_parts(meta: CheckpointMeta) -> dict[str, str]:
    """``{part name: what the checkpoint says of it}`` for each part the model has."""
    tensors = {k: t for k, t in meta.tensors.items() if not is_optimizer_key(k)}
    out = {}
    for part in PARTS:
        words = part.describe(tensors)
        if words:
            out[part.name] = words
    return out


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)
