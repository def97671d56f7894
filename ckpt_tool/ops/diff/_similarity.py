"""How close each tensor of a conversion is to its source: ``diff``'s similarity report.

For each tensor both sides hold (read a piece at a time, float64 sums): the cosine similarity
``a·b / (|a| |b|)`` (1.0 when both are all zeros, 0.0 when only one is), the largest absolute
error ``max |a - b|`` and the largest relative error ``max |a - b| / max |b|`` (relative to
B's largest magnitude, so that rounding near zero does not dominate). A tensor proven equal
by its bytes is 1.0, 0, 0 without being read.

"Disagrees" means a cosine below :data:`COSINE_FLOOR` (0.99): rounding to bf16 or to
block-scaled FP8 (e4m3: at most 2^-4 of each value) keeps the cosine above 0.998, while a
transposed or swapped projection, or another layer's tensor, falls near 0.
:func:`first_disagreeing` names the first such tensor in model order (layer by layer,
numbers compared as numbers). :func:`plot` draws each layer's lowest cosine (matplotlib, the
``bench`` extra).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ckpt_tool.errors import UsageError

__all__ = ["Similarity", "Accumulator", "COSINE_FLOOR", "model_order", "first_disagreeing",
           "layer_of", "check_plotting", "plot"]

COSINE_FLOOR = 0.99
_ELEMS = 1 << 22
_NUM = re.compile(r"(\d+)")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


@dataclass(frozen=True)
class Similarity:
    """One tensor's closeness (see the module docstring)."""

    key: str
    cosine: float
    max_abs_error: float
    max_rel_error: float

    def to_dict(self) -> dict[str, Any]:
        from ckpt_tool.ops.diff._values import js

        return {k: js(getattr(self, k)) for k in self.__dataclass_fields__}


class Accumulator:
    """The sums behind a :class:`Similarity`, fed piece by piece (same-shape pairs)."""

    def __init__(self) -> None:
        self.dot = self.aa = self.bb = 0.0
        self.max_abs = self.max_ref = 0.0

    def add(self, a: Any, b: Any) -> None:
        import torch

        x, y = a.reshape(-1), b.reshape(-1)
        for s in range(0, x.numel(), _ELEMS):
            u = x[s:s + _ELEMS].to(torch.float64)
            v = y[s:s + _ELEMS].to(torch.float64)
            self.dot += float(u @ v)
            self.aa += float(u @ u)
            self.bb += float(v @ v)
            if u.numel():
                self.max_abs = max(self.max_abs, float((u - v).abs().max()))
                self.max_ref = max(self.max_ref, float(v.abs().max()))

    def result(self, key: str) -> Similarity:
        if self.aa == 0 or self.bb == 0:
            cos = 1.0 if self.aa == self.bb else 0.0
        else:
            cos = self.dot / math.sqrt(self.aa * self.bb)
        rel = self.max_abs / self.max_ref if self.max_ref else (0.0 if not self.max_abs
                                                                else math.inf)
        return Similarity(key, cos, self.max_abs, rel)


def model_order(key: str) -> tuple[Any, ...]:
    """Sort key: numbers as numbers (``layers.2`` before ``layers.10``)."""
    return tuple(int(p) if p.isdigit() else p for p in _NUM.split(key))


def layer_of(key: str) -> int | None:
    """The decoder layer of ``key`` (``model.layers.3.…`` -> 3), None outside the layers."""
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


def first_disagreeing(sims: Iterable[Similarity]) -> Similarity | None:
    """The first tensor in model order whose cosine is below :data:`COSINE_FLOOR`."""
    return next((s for s in sorted(sims, key=lambda s: model_order(s.key))
                 if not s.cosine >= COSINE_FLOOR), None)


def check_plotting() -> None:
    """UsageError (one line) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed",
                         hint="pip install 'ckpt[bench]' (or matplotlib)") from None


def plot(sims: Iterable[Similarity], path: Path, title: str) -> None:
    """Each layer's lowest cosine (line) and every tensor's (dots) into ``path`` (PNG)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per: dict[int, list[float]] = {}
    for s in sims:
        layer = layer_of(s.key)
        if layer is not None and math.isfinite(s.cosine):
            per.setdefault(layer, []).append(s.cosine)
    layers = sorted(per)
    fig, ax = plt.subplots(figsize=(max(6.0, len(layers) * 0.25), 4))
    for i in layers:
        ax.scatter([i] * len(per[i]), per[i], s=8, color="tab:gray", alpha=0.6)
    ax.plot(layers, [min(per[i]) for i in layers], marker="o", color="tab:blue",
            label="lowest cosine in the layer")
    ax.axhline(COSINE_FLOOR, color="tab:red", linestyle="--", label=f"{COSINE_FLOOR}")
    ax.set_xlabel("layer")
    ax.set_ylabel("cosine similarity")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    tmp.replace(path)
