"""``convert --to hf --hf-dtype fp8``: the export written as block-scaled FP8, the form the
DeepSeek-V3, Kimi-K2 and Qwen3-FP8 releases use.

Which tensors are quantized follows the releases and transformers' FP8 integration (which
replaces ``nn.Linear`` modules only): the linear weights of attention and of the MLP and its
experts (Megatron-Core ``linear_*`` weights, e.g. ``linear_qkv``, ``linear_proj``,
``linear_fc1``/``fc2``, MLA's ``linear_q_down_proj``); never norms, biases, embeddings, the
output layer (``lm_head``), routers or gates, nor GPT-2's Conv1D weights. A linear whose rows
or columns do not divide into whole blocks stays unquantized (as transformers' own quantizer
leaves it: its CPU dequantization refuses partial blocks) and is named, with ``lm_head``, in
``quantization_config.modules_to_not_convert``.

:class:`Fp8Source` wraps the export's tensor source: a request for rows of a quantized weight
(or of its ``weight_scale_inv`` grid) reads the whole row blocks covering them from the inner
source, quantizes them (:func:`ckpt_tool.formats.hf.quant_codecs.quantize_fp8`) and cuts the
request out; the last slab is kept, so the scale grid that follows its weight costs no
second read.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from ckpt_tool.formats.hf.quant_view import Fp8Blocks, fp8_scale_key
from ckpt_tool.model import TensorMeta
from ckpt_tool.planning.hf_plan import Recipe

__all__ = ["plan_fp8", "Fp8Source"]


def _quantizable(r: Recipe) -> bool:
    if len(r.shape) != 2 or not r.key.endswith(".weight"):
        return False
    for p in r.parts:
        if p.op == "t" or dict(p.params).get("transpose"):
            return False  # a Conv1D weight (GPT-2): not an nn.Linear
        for s in p.sources:
            module = s.key.rsplit(".", 2)[-2] if s.key.count(".") >= 2 else ""
            if not (module.startswith("linear_") and s.key.endswith(".weight")):
                return False
    return True


def plan_fp8(recipes: list[Recipe], target: dict[str, TensorMeta], scheme: Fp8Blocks
             ) -> tuple[dict[str, TensorMeta], dict[str, tuple[int, int]], dict[str, Any]]:
    """The target tensors with FP8 weights and their scale grids, ``{weight key: shape}`` of
    the quantized ones, and the ``quantization_config`` for config.json."""
    bm, bn = scheme.block
    out = dict(target)
    quantized: dict[str, tuple[int, int]] = {}
    skipped = ["lm_head"]
    for r in recipes:
        if not _quantizable(r):
            continue
        rows, cols = r.shape
        module = r.key[:-len(".weight")]
        if rows % bm or cols % bn:
            skipped.append(module)
            continue
        quantized[r.key] = (rows, cols)
        t = target[r.key]
        out[r.key] = replace(t, dtype="float8_e4m3fn")
        sk = fp8_scale_key(r.key)
        grid = (rows // bm, cols // bn)
        out[sk] = TensorMeta(key=sk, dtype="float32", shape=grid,
                             chunks=(replace(t.chunks[0], offsets=(0, 0), sizes=grid),))
    return out, quantized, scheme.config(skipped)


class Fp8Source:
    """``TensorSource``: ``inner``'s tensors, the ``quantized`` weights in FP8 and their
    ``weight_scale_inv`` grids computed (see the module docstring)."""

    def __init__(self, inner: Any, quantized: dict[str, tuple[int, int]], scheme: Fp8Blocks):
        self.inner, self.quantized, self.block = inner, quantized, scheme.block
        self.scales = {fp8_scale_key(k): k for k in quantized}
        self._last: tuple[tuple[str, int, int], Any, Any] | None = None
        self._lock = threading.Lock()

    @property
    def largest_piece(self) -> int:
        return self.inner.largest_piece

    @property
    def tensors_done(self) -> int:
        return self.inner.tensors_done

    def _slab(self, key: str, b0: int, b1: int) -> tuple[Any, Any]:
        """(FP8 rows, scale rows) of row blocks ``b0:b1`` of weight ``key``."""
        from ckpt_tool.formats.hf.quant_codecs import quantize_fp8

        with self._lock:
            if self._last is not None and self._last[0] == (key, b0, b1):
                return self._last[1], self._last[2]
            self._last = None
        rows, cols = self.quantized[key]
        r0, r1 = b0 * self.block[0], min(b1 * self.block[0], rows)
        w = self.inner.read(key, (r0, 0), (r1 - r0, cols))
        q, inv = quantize_fp8(w, self.block)
        with self._lock:
            self._last = ((key, b0, b1), q, inv)
        return q, inv

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The rectangle ``offsets``/``sizes`` of target tensor ``key``."""
        bm = self.block[0]
        if key in self.quantized:
            (r, c), (n, m) = offsets, sizes
            b0, b1 = r // bm, -(-(r + n) // bm)
            q, _ = self._slab(key, b0, b1)
            return q[r - b0 * bm:r - b0 * bm + n, c:c + m].contiguous()
        weight = self.scales.get(key)
        if weight is not None:
            (g, c), (n, m) = offsets, sizes
            _, inv = self._slab(weight, g, g + n)
            return inv[:, c:c + m].contiguous()
        return self.inner.read(key, offsets, sizes)
