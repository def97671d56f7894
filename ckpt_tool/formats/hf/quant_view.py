"""The dequantized view of a quantized Hugging Face release (``config.json``
``quantization_config``): which stored tensors pair up, the logical tensors they make, and
reads of any region of those, a slab of rows at a time (:mod:`.quant_codecs` does the
arithmetic).

:func:`scheme_of` reads the config: ``quant_method`` ``"fp8"`` (block-scaled e4m3, dynamic
activations, float32 scales) or ``"mxfp4"``; any other method (GPTQ, AWQ, bitsandbytes, NVFP4
through ModelOpt or compressed-tensors, ...) is an :class:`UnsupportedError`. A quantized
weight without its scale tensor, a scale without its weight or a scale grid of the wrong shape
is a :class:`CorruptCheckpointError`; both are raised while the metadata is read, before any
output exists.

The logical tensors take the model's dtype (``config.json`` ``torch_dtype``/``dtype``, else
bfloat16), as transformers' loaders do; their chunks name the stored weight's file without a
byte range (the bytes are not the values: byte-level checks leave them to ``read``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

from ckpt_tool.errors import CorruptCheckpointError, UnsupportedError
from ckpt_tool.model import ChunkRef, TensorMeta

__all__ = ["Fp8Blocks", "Mxfp4", "scheme_of", "QuantView", "FP8_LAYOUT", "MXFP4_LAYOUT",
           "fp8_scale_key", "model_dtype"]

FP8_LAYOUT = "fp8_blocks"  # ChunkRef.layout of a dequantized FP8 weight
MXFP4_LAYOUT = "mxfp4"
_SLAB_ELEMS = 1 << 24  # elements dequantized at once (float32 intermediates: 64 MiB)
_FLOATS = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Fp8Blocks:
    """Block-scaled float8_e4m3fn weights, ``block`` = (rows, cols) per scale."""

    block: tuple[int, int] = (128, 128)

    def config(self, skipped: list[str]) -> dict[str, Any]:
        """The ``quantization_config`` the releases write (DeepSeek-V3's keys)."""
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if skipped:
            out["modules_to_not_convert"] = skipped
        return out


@dataclass(frozen=True)
class Mxfp4:
    """MXFP4: e2m1 pairs per byte, an e8m0 exponent per 32 values."""


def model_dtype(config: dict[str, Any]) -> str:
    """The dtype the model computes in: ``torch_dtype``/``dtype`` of config.json, else bf16."""
    d = config.get("torch_dtype") or config.get("dtype")
    d = str(d).removeprefix("torch.") if d else "bfloat16"
    return d if d in _FLOATS else "bfloat16"


def _unsupported(what: str, path: Any) -> UnsupportedError:
    return UnsupportedError(
        f"config.json quantization_config: {what}; ckpt reads block-scaled FP8 "
        "(quant_method fp8, e4m3, float32 scales) and MXFP4 (quant_method mxfp4)", path=path,
        hint="dequantize the release with its own tools first, or use an unquantized release")


def scheme_of(config: dict[str, Any], path: Any = None) -> Fp8Blocks | Mxfp4 | None:
    """The quantization of ``config`` (a parsed config.json); None when unquantized."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CorruptCheckpointError("config.json quantization_config is not an object",
                                     path=path)
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":
        return Mxfp4()
    if method != "fp8":
        algo = q.get("quant_algo") or q.get("format")
        return _raise(_unsupported(f"quant_method {method or 'missing'!r}"
                                   + (f" ({algo})" if algo else "") + " is not supported", path))
    for field, allowed in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)),
                           ("scale_fmt", ("float",)), ("expert_dtype", ("fp8",))):
        if field in q and q[field] is not None and str(q[field]).lower() not in allowed:
            raise _unsupported(f"fp8 with {field} {q[field]!r} is not supported", path)
    block = q.get("weight_block_size", (128, 128))
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise _unsupported(f"weight_block_size {block!r} is not two positive integers", path)
    return Fp8Blocks((block[0], block[1]))


def _raise(exc: Exception) -> Any:
    raise exc


def fp8_scale_key(key: str) -> str:
    """The scale tensor of FP8 weight ``key`` (transformers' naming)."""
    return key[:-len("weight")] + "weight_scale_inv" if key.endswith(".weight") \
        else key + "_scale_inv"


class QuantView:
    """The logical tensors of the stored tensors ``stored`` (key -> TensorMeta) under
    ``scheme``; ``read_stored(key, slices)`` reads a stored tensor."""

    def __init__(self, scheme: Fp8Blocks | Mxfp4, stored: dict[str, TensorMeta], dtype: str,
                 read_stored: Callable[[str, tuple[slice, ...] | None], Any], path: Any):
        self.scheme, self.dtype, self.read_stored, self.path = scheme, dtype, read_stored, path
        self.pairs: dict[str, tuple[str, str]] = {}  # logical key -> (values, scales)
        self.tensors: dict[str, TensorMeta] = {}
        if isinstance(scheme, Fp8Blocks):
            self._pair_fp8(stored)
        else:
            self._pair_mxfp4(stored)
        hidden = {k for pair in self.pairs.values() for k in pair}
        for key, t in stored.items():
            if key not in hidden:
                self.tensors[key] = t
        for key in self.pairs:
            self.tensors[key] = self._logical[key]

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(what, path=self.path,
                                      hint="copy the release's missing or damaged shard again")

    def _pair_fp8(self, stored: dict[str, TensorMeta]) -> None:
        bm, bn = self.scheme.block  # type: ignore[union-attr]
        self._logical: dict[str, TensorMeta] = {}
        scales = {k for k in stored if k.endswith("_scale_inv")}
        for key, t in stored.items():
            if t.dtype != "float8_e4m3fn":
                continue
            sk = fp8_scale_key(key)
            s = stored.get(sk)
            if s is None:
                raise self._bad(f"FP8 weight {key} has no scale tensor {sk}")
            if len(t.shape) < 2:
                raise self._bad(f"FP8 weight {key} is {list(t.shape)}: block scales need "
                                "[..., rows, cols]")
            *lead, rows, cols = t.shape
            want = (*lead, -(-rows // bm), -(-cols // bn))
            if tuple(s.shape) != want:
                raise self._bad(f"{sk} is {list(s.shape)}; {key} {list(t.shape)} in "
                                f"{bm}x{bn} blocks needs {list(want)}")
            if s.dtype not in _FLOATS:
                raise _unsupported(f"{sk} is {s.dtype} (scale_fmt ue8m0 or another encoding)"
                                   " and is not supported", self.path)
            self.pairs[key] = (key, sk)
            self._logical[key] = self._meta(key, t, tuple(t.shape), FP8_LAYOUT)
            scales.discard(sk)
        for sk in sorted(scales):
            raise self._bad(f"scale tensor {sk} has no FP8 weight (its weight is "
                            f"{stored[sk].dtype if sk in stored else 'missing'})")

    def _pair_mxfp4(self, stored: dict[str, TensorMeta]) -> None:
        self._logical = {}
        self._group: dict[str, int] = {}  # values per scale (2 per byte of the last dim)
        scales = {k for k in stored if k.endswith("_scales")}
        for key, t in stored.items():
            if not key.endswith("_blocks"):
                continue
            base = key[:-len("_blocks")]
            sk = base + "_scales"
            s = stored.get(sk)
            if s is None:
                raise self._bad(f"MXFP4 blocks {key} have no scale tensor {sk}")
            if len(t.shape) < 3 or t.dtype != "uint8" or s.dtype != "uint8":
                raise self._bad(f"MXFP4 {key} is {t.dtype} {list(t.shape)} with {s.dtype} "
                                "scales; expected uint8 [..., rows, groups, 16] and uint8 "
                                "[..., rows, groups]")
            if tuple(s.shape) != tuple(t.shape[:-1]):
                raise self._bad(f"{sk} is {list(s.shape)}; {key} {list(t.shape)} needs "
                                f"{list(t.shape[:-1])}")
            *lead, rows, groups, nb = t.shape
            self.pairs[base] = (key, sk)
            self._group[base] = nb * 2
            self._logical[base] = self._meta(base, t, (*lead, groups * nb * 2, rows),
                                             MXFP4_LAYOUT)
            scales.discard(sk)
        for sk in sorted(scales):
            if sk[:-len("_scales")] + "_blocks" not in stored:
                raise self._bad(f"scale tensor {sk} has no MXFP4 blocks")

    def _meta(self, key: str, stored: TensorMeta, shape: tuple[int, ...],
              layout: str) -> TensorMeta:
        file = stored.chunks[0].file if stored.chunks else None
        return TensorMeta(key=key, dtype=self.dtype, shape=shape,
                          chunks=(ChunkRef(offsets=(0,) * len(shape), sizes=shape, file=file,
                                           layout=layout),))

    def summary(self) -> dict[str, Any]:
        """For ``metadata().extras["quantization"]``."""
        if isinstance(self.scheme, Fp8Blocks):
            return {"method": "fp8", "block": list(self.scheme.block),
                    "quantized_tensors": len(self.pairs), "dtype": self.dtype}
        return {"method": "mxfp4", "quantized_tensors": len(self.pairs), "dtype": self.dtype}

    def describe(self) -> str:
        """One line: the stored form and what it is read as."""
        form = (f"fp8 e4m3, {self.scheme.block[0]}x{self.scheme.block[1]} blocks"
                if isinstance(self.scheme, Fp8Blocks) else "mxfp4 (e2m1, e8m0 per 32)")
        return f"{form}: {len(self.pairs)} tensors read dequantized to {self.dtype}"

    def read(self, key: str, slices: tuple[slice, ...] | None) -> Any:
        """Region ``slices`` (step 1) of logical tensor ``key``, dequantized a slab at a time."""
        import torch

        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        t = self.tensors[key]
        box = [(0, n) for n in t.shape] if slices is None else [
            sl.indices(n)[:2] for sl, n in zip(slices, t.shape)] + [
            (0, n) for n in t.shape[len(slices):]]
        out = torch.empty([b - a for a, b in box], dtype=torch_dtype(self.dtype))
        # slabs along the outermost dimension that keeps a slab under _SLAB_ELEMS
        sizes = [b - a for a, b in box]
        d = next((i for i in range(len(sizes)) if math.prod(sizes[i + 1:]) <= _SLAB_ELEMS),
                 len(sizes) - 1)
        step = max(1, _SLAB_ELEMS // max(1, math.prod(sizes[d + 1:])))
        if isinstance(self.scheme, Fp8Blocks) and d == len(sizes) - 2:
            step = max(self.scheme.block[0], step // self.scheme.block[0]
                       * self.scheme.block[0])  # whole row blocks
        for pre in itertools.product(*(range(a, b) for a, b in box[:d])):
            for s in range(box[d][0], box[d][1], step):
                sub = [(i, i + 1) for i in pre] + [(s, min(s + step, box[d][1]))] + box[d + 1:]
                dst = tuple(slice(a - o[0], b - o[0]) for (a, b), o in zip(sub, box))
                out[dst] = self._region(key, sub)
        return out

    def _region(self, key: str, box: list[tuple[int, int]]) -> Any:
        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        vk, sk = self.pairs[key]
        dtype = torch_dtype(self.dtype)
        lead = [slice(a, b) for a, b in box[:-2]]
        if isinstance(self.scheme, Fp8Blocks):
            from ckpt_tool.formats.hf.quant_codecs import dequantize_fp8

            bm, bn = self.scheme.block
            (r0, r1), (c0, c1) = box[-2:]
            w = self.read_stored(vk, (*lead, slice(r0, r1), slice(c0, c1)))
            s = self.read_stored(sk, (*lead, slice(r0 // bm, -(-r1 // bm)),
                                      slice(c0 // bn, -(-c1 // bn))))
            return dequantize_fp8(w, s, (bm, bn), dtype, (r0, r1), (c0, c1))
        from ckpt_tool.formats.hf.quant_codecs import decode_mxfp4

        (i0, i1), (o0, o1) = box[-2:]  # logical [..., in, out] = stored [..., out, in]
        group = self._group[key]
        g0, g1 = i0 // group, -(-i1 // group)
        b = self.read_stored(vk, (*lead, slice(o0, o1), slice(g0, g1)))
        s = self.read_stored(sk, (*lead, slice(o0, o1), slice(g0, g1)))
        v = decode_mxfp4(b, s, dtype)
        return v[..., i0 - g0 * group:i1 - g0 * group].transpose(-1, -2)
