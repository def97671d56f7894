"""The arithmetic of the quantized forms Hugging Face releases store (torch, no I/O).

* Block-scaled FP8 (DeepSeek-V3, Kimi-K2, Qwen3-FP8; transformers ``quant_method: "fp8"``):
  ``weight`` float8_e4m3fn ``[..., rows, cols]`` with ``weight_scale_inv`` float32
  ``[..., ceil(rows/bm), ceil(cols/bn)]``; value = float32(weight[r, c]) *
  weight_scale_inv[r // bm, c // bn], rounded once to the model's dtype. Edge blocks may be
  partial (V3's ``kv_a_proj_with_mqa`` has 576 rows).
* Quantizing (``--hf-dtype fp8``): per block, scale = 448 / amax (1 where amax is 0),
  weight = e4m3(clamp(w * scale, -448, 448)), ``weight_scale_inv`` = float32(1 / scale).
* MXFP4 (GPT-OSS experts; ``quant_method: "mxfp4"``): ``*_blocks`` uint8
  ``[..., rows, groups, 16]``, two e2m1 codes per byte (low nibble first), and ``*_scales``
  uint8 ``[..., rows, groups]``, an e8m0 exponent per 32 values: value =
  E2M1[code] * 2^(scale - 127). transformers hands the result out with its last two dims
  swapped (``[experts, in, out]``), as the unquantized GPT-OSS tensors are stored.

docs/formats.md ("Quantized Hugging Face releases") cites the releases' own code these
formulas are checked against. Every function works on the piece it is given (a slab of rows),
so callers bound memory by the pieces they pass.

Regions made of whole blocks (every block of DeepSeek-V3 but ``kv_a_proj_with_mqa``'s last
row of blocks) take a faster path with the same arithmetic: e4m3 codes to float32 through a
256-entry table (torch's element-wise cast from float8 is not vectorized on CPU), and the
scales broadcast over a ``[row blocks, bm, column blocks, bn]`` view instead of expanded to
one per element; quantizing computes the block amax from that view and scales in place.
"""

from __future__ import annotations

from typing import Any

__all__ = ["E4M3_MAX", "E2M1_VALUES", "dequantize_fp8", "quantize_fp8", "decode_mxfp4",
           "expand_scales"]

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def expand_scales(scales: Any, block: tuple[int, int], rows: tuple[int, int],
                  cols: tuple[int, int]) -> Any:
    """Per-element float32 scales of the region ``rows`` x ``cols`` (``(start, stop)`` in
    the weight) from the block scales covering it (``scales[..., r0 // bm :, c0 // bn :]``)."""
    import torch

    bm, bn = block
    s = scales.to(torch.float32)
    s = s.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    r, c = rows[0] - (rows[0] // bm) * bm, cols[0] - (cols[0] // bn) * bn
    return s[..., r:r + rows[1] - rows[0], c:c + cols[1] - cols[0]]


_E4M3_TABLE: list = []


def _e4m3_to_float32(weight: Any) -> Any:
    """float32 values of e4m3 ``weight`` (a new tensor), through a table of the 256 codes."""
    import torch

    if not _E4M3_TABLE:
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
        _E4M3_TABLE.append(codes.to(torch.float32).numpy())
    raw = weight.contiguous().view(torch.uint8).numpy()
    return torch.from_numpy(_E4M3_TABLE[0][raw])


def _whole_blocks(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    return len(shape) >= 2 and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0


def _block_view(x: Any, block: tuple[int, int]) -> Any:
    *lead, rows, cols = x.shape
    return x.view(*lead, rows // block[0], block[0], cols // block[1], block[1])


def _per_block(s: Any) -> Any:
    """Block values ``[..., gr, gc]`` shaped to broadcast over a ``_block_view``."""
    return s.unsqueeze(-1).unsqueeze(-3)


def dequantize_fp8(weight: Any, scales: Any, block: tuple[int, int], dtype: Any,
                   rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None
                   ) -> Any:
    """``weight`` (a region of an FP8 weight: ``rows``/``cols`` of it, default all) times
    its block scales (the blocks covering the region), in float32, then ``dtype``."""
    import torch

    rows = rows or (0, weight.shape[-2])
    cols = cols or (0, weight.shape[-1])
    if (rows[0] % block[0] == 0 and cols[0] % block[1] == 0
            and _whole_blocks(tuple(weight.shape), block)):
        x = _e4m3_to_float32(weight)
        _block_view(x, block).mul_(_per_block(scales.to(torch.float32)))
        return x.to(dtype)
    s = expand_scales(scales, block, rows, cols)
    return (weight.to(torch.float32) * s).to(dtype)


def quantize_fp8(w: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """``(weight e4m3, weight_scale_inv float32)`` of ``w`` ``[..., rows, cols]`` in blocks
    of ``block`` (edge blocks may be partial)."""
    import torch

    bm, bn = block
    *lead, rows, cols = w.shape
    gr, gc = -(-rows // bm), -(-cols // bn)
    if _whole_blocks(tuple(w.shape), block):
        x = w.to(torch.float32, copy=True)
        v = _block_view(x, block)
        amax = torch.maximum(v.amax(dim=(-3, -1)), v.amin(dim=(-3, -1)).neg_())
        scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0),
                            torch.ones_like(amax))
        v.mul_(_per_block(scale))
        q = x.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q, (1.0 / scale).to(torch.float32)
    x = w.to(torch.float32)
    pad = torch.zeros((*lead, gr * bm, gc * bn), dtype=torch.float32)
    pad[..., :rows, :cols] = x.abs()
    amax = pad.reshape(*lead, gr, bm, gc, bn).amax(dim=(-3, -1))
    del pad
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0),
                        torch.ones_like(amax))
    inv = (1.0 / scale).to(torch.float32)
    full = scale.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)[..., :rows, :cols]
    q = torch.clamp(x * full, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, inv


def decode_mxfp4(blocks: Any, scales: Any, dtype: Any) -> Any:
    """Values ``[..., rows, groups * 32]`` of MXFP4 ``blocks`` ``[..., rows, groups, 16]``
    with ``scales`` ``[..., rows, groups]`` (not transposed), in float32, then ``dtype``."""
    import torch

    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    out = torch.empty((*b.shape[:-1], b.shape[-1] * 2), dtype=torch.float32)
    out[..., 0::2] = lut[(b & 0x0F).long()]
    out[..., 1::2] = lut[(b >> 4).long()]
    exp = torch.exp2(scales.to(torch.float32) - 127.0)
    out *= exp.unsqueeze(-1)
    return out.reshape(*b.shape[:-2], b.shape[-2] * b.shape[-1] * 2).to(dtype)
