"""Model sizes and parallel layouts, vocab padding and where each global layer lives.

Layer placement follows Megatron-Core's ``get_transformer_layer_offset``: model chunks are
ordered ``(virtual stage, pipeline stage)``; with ``first``/``last`` overrides the first/last
pipeline stage holds that many layers (split evenly over its virtual stages) and the middle
stages share the rest evenly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ModelSizes", "Layout", "padded_vocab_size", "stage_layer_counts", "LayerMap",
           "rank_dir_name"]


@dataclass(frozen=True)
class ModelSizes:
    """The sizes of a GPT-family model that decide how it can be split (from ``args`` or from
    the tensor shapes). ``vocab_size`` is the tokenizer's (unpadded) vocab when known;
    ``padded_vocab_size`` the rows of the embedding as stored."""

    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    padded_vocab_size: int | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    gated_linear_unit: bool = False
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    attention_output_gate: bool = False

    def with_(self, **kw: Any) -> ModelSizes:
        return replace(self, **kw)

    @property
    def heads_per_group(self) -> int | None:
        if self.num_attention_heads and self.num_query_groups:
            return self.num_attention_heads // self.num_query_groups
        return None

    @property
    def qkv_rows(self) -> int | None:
        """Rows of the fused ``linear_qkv`` weight: ``(np + 2 ng) * head_dim`` (+ ``np *
        head_dim`` with an attention output gate)."""
        np_, ng, hd = self.num_attention_heads, self.num_query_groups, self.kv_channels
        if not (np_ and ng and hd):
            return None
        return (np_ * (2 if self.attention_output_gate else 1) + 2 * ng) * hd


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor, pipeline, virtual pipeline, expert and expert-tensor
    parallel sizes plus the uneven first/last pipeline stage layer counts."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_ranks(self) -> list[tuple[int, int, int]]:
        """Every ``(tp, pp, ep)`` rank, in the order Megatron-LM names its rank files."""
        return [(t, p, e) for p in range(self.pp) for t in range(self.tp) for e in range(self.ep)]

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "etp": self.expert_tp,
                "vpp": self.vpp, "first_stage_layers": self.first_stage_layers,
                "last_stage_layers": self.last_stage_layers}


def padded_vocab_size(vocab: int, tp: int, divisible_by: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: the next multiple of
    ``divisible_by * tp``."""
    multiple = max(divisible_by, 1) * max(tp, 1)
    return -(-vocab // multiple) * multiple


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None,
                       last: int | None = None) -> list[int]:
    """Layers on each pipeline stage; ValueError (with the reason) when they do not split."""
    if pp <= 1:
        return [num_layers]
    counts: list[int | None] = [None] * pp
    rest, middle = num_layers, pp
    if first is not None:
        counts[0], rest, middle = first, rest - first, middle - 1
    if last is not None:
        counts[-1], rest, middle = last, rest - last, middle - 1
    if middle:
        if rest < 0 or rest % middle:
            what = "middle " if (first is not None or last is not None) else ""
            raise ValueError(f"{rest} {what}layers do not split evenly over {middle} "
                             f"{what}pipeline stages")
        counts = [rest // middle if c is None else c for c in counts]
    elif rest != 0:
        raise ValueError(f"first/last stage layer counts ({first}, {last}) do not add up to "
                         f"{num_layers} layers")
    return [int(c or 0) for c in counts]


class LayerMap:
    """Global layer index <-> ``(pipeline stage, virtual stage, local index)``.

    The local index is the layer number inside one model chunk (``decoder.layers.{i}`` in that
    chunk's state dict, which Megatron-LM's legacy files use)."""

    def __init__(self, num_layers: int, layout: Layout):
        vpp = layout.vpp or 1
        counts = stage_layer_counts(num_layers, layout.pp, layout.first_stage_layers,
                                    layout.last_stage_layers)
        if any(c % vpp for c in counts):
            raise ValueError(f"stage layer counts {counts} do not split over {vpp} virtual "
                             "stages")
        self.num_layers, self.pp, self.vpp = num_layers, layout.pp, vpp
        per_chunk = [c // vpp for c in counts]
        self._chunks: list[tuple[int, int, int, int]] = []  # (pp, vp, offset, count)
        acc = 0
        for vp in range(vpp):
            for p in range(layout.pp):
                self._chunks.append((p, vp, acc, per_chunk[p]))
                acc += per_chunk[p]

    def offset(self, pp: int, vp: int = 0) -> int:
        """Global index of local layer 0 of model chunk ``(pp, vp)``."""
        for p, v, off, _ in self._chunks:
            if (p, v) == (pp, vp):
                return off
        raise IndexError(f"no model chunk pp={pp} vp={vp}")

    def layers_of(self, pp: int, vp: int | None = None) -> list[int]:
        """Global layer indices held by pipeline stage ``pp`` (one virtual stage or all)."""
        return [off + i for p, v, off, n in self._chunks
                if p == pp and (vp is None or v == vp) for i in range(n)]

    def locate(self, layer: int) -> tuple[int, int, int]:
        """``(pp, vp, local index)`` of global layer ``layer``."""
        for p, v, off, n in self._chunks:
            if off <= layer < off + n:
                return p, v, layer - off
        raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")

    def global_index(self, pp: int, local: int, vp: int = 0) -> int:
        return self.offset(pp, vp) + local


def rank_dir_name(tp: int, pp: int, ep: int, pp_size: int, ep_size: int) -> str:
    """Megatron-LM's ``get_checkpoint_name`` directory for one model-parallel rank."""
    name = f"mp_rank_{tp:02d}"
    if pp_size > 1:
        name += f"_{pp:03d}"
    if ep_size > 1:
        name += f"_{ep:03d}"
    return name
