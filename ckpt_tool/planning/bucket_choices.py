"""What a DistributedOptimizer bucket layout may be, when the configuration leaves it open
(pure; no I/O).

The layout of ``dp_reshardable`` / ``dp_zero_gather_scatter`` state (docs/optimizer.md) depends
on the model's layer spec (the parameter order), the data-parallel size (where a bucket is split
over DP ranks, and its end padding) and whether buckets are padded for NCCL bus bandwidth. The
configuration a checkpoint carries (Megatron-LM's ``args``, Megatron-Bridge's or NeMo's files)
or the user's flags decide each of them; what they leave open is tried, each choice proven
against every stored piece, and a choice is used only when all the proven ones place every
parameter alike. :func:`layout_choices` lists what to try, :func:`dp_candidates` the
data-parallel sizes the stored pieces allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ckpt_tool.model import CheckpointMeta
from ckpt_tool.planning.optim_buckets import BUCKET_KEY

__all__ = ["LayoutChoice", "layout_choices", "dp_candidates", "stored_bucket_sizes", "SPECS",
           "spec_from_args"]

#: The layer specs whose parameter order is known (planning.param_order), in the order tried.
SPECS = ("transformer_engine", "local")
_SPEC_NAMES = {"transformer_engine": "Transformer-Engine", "local": "local"}


@dataclass(frozen=True)
class LayoutChoice:
    """One way DDP may have laid the buffers out: the layer spec, the data-parallel size and
    the bus-bandwidth bucket padding (``ddp_pad_buckets_for_high_nccl_busbw``)."""

    spec: str
    dp: int
    busbw: bool

    def args(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``args`` with this choice's padding rule."""
        return {**args, "ddp_pad_buckets_for_high_nccl_busbw": self.busbw}

    @property
    def spec_name(self) -> str:
        return _SPEC_NAMES.get(self.spec, self.spec)


def spec_from_args(args: Mapping[str, Any]) -> str | None:
    """The layer spec ``args.transformer_impl`` names (None when it names none)."""
    impl = args.get("transformer_impl")
    if impl == "local":
        return "local"
    return "transformer_engine" if impl == "transformer_engine" else None


def layout_choices(args: Mapping[str, Any], dps: Sequence[int], spec: str | None = None,
                   padded: Iterable[int] = ()) -> list[LayoutChoice]:
    """Every choice to try: ``spec`` (else the configuration's, else each known spec), each
    of ``dps``, the configuration's bucket padding (else both; the bus-bandwidth padding only
    when every stored ``padded`` bucket size is a multiple of 2**16: none stored, it moves
    nothing)."""
    specs = [spec] if spec else ([spec_from_args(args)] if spec_from_args(args) else
                                 list(SPECS))
    key = "ddp_pad_buckets_for_high_nccl_busbw"
    padded = list(padded)
    busbws = ([bool(args[key])] if key in args else
              [False] + ([True] if padded and all(n % 2 ** 16 == 0 for n in padded) else []))
    return [LayoutChoice(s, d, b) for s in specs for d in dps for b in busbws]


def stored_bucket_sizes(per_bucket: Mapping[Any, tuple[Any, Any]],
                        which: int = 1) -> dict[tuple[str, int], list[list[int]]]:
    """The stored bucket sizes per optimizer domain ``(prefix, dp_group_idx)``, one list per
    buffer: ``which`` 1 for ``per_bucket_numel_unpadded``, 0 for ``per_bucket_numel`` (as
    saved: a list over buffers of ``{(param dtype, grad dtype): [numel, ...]}``)."""
    out: dict[tuple[str, int], list[list[int]]] = {}
    for domain, values in per_bucket.items():
        key = domain if isinstance(domain, tuple) else ("", int(domain))
        out[key] = [[int(n) for numels in dict(per_dtype).values() for n in numels]
                    for per_dtype in values[which] or []]
    return out


def dp_candidates(meta: CheckpointMeta, per_bucket: Mapping[Any, tuple[Any, Any]]
                  ) -> list[int]:
    """The data-parallel sizes the stored dense buckets allow, smallest first: ``d`` divides
    every bucket's padded size and each DP rank's share starts where a stored piece starts
    (below the bucket's unpadded size). A necessary condition only: the proof of a layout
    built with ``d`` decides. Empty when no buckets are stored."""
    padded = stored_bucket_sizes(per_bucket, 0)
    unpadded = stored_bucket_sizes(per_bucket, 1)
    starts: dict[tuple[str, int, int, int], set[int]] = {}
    for k, t in meta.tensors.items():
        m = BUCKET_KEY.match(k)
        if m and m.group(6) == "param" and (m.group(1) or "chained_0.") == "chained_0.":
            starts[(m.group(1) or "", int(m.group(2)), int(m.group(3)), int(m.group(5)))] = {
                c.offsets[0] for c in t.chunks}
    buckets = [(starts[(p, i, g, b)], n, unpadded[(p, i)][g][b])
               for (p, i), buffers in padded.items() for g, sizes in enumerate(buffers)
               for b, n in enumerate(sizes) if (p, i, g, b) in starts
               and g < len(unpadded.get((p, i), ())) and b < len(unpadded[(p, i)][g])]
    if not buckets:
        return []
    common = math.gcd(*(n for _s, n, _u in buckets))
    return [d for d in _divisors(common) if all(_splits_at_pieces(got, n, u, d)
                                                 for got, n, u in buckets)]


def _splits_at_pieces(starts: set[int], padded: int, unpadded: int, dp: int) -> bool:
    """Whether each of ``dp`` ranks' shares of a bucket starts at a stored piece."""
    shares = min(dp - 1, -(-unpadded * dp // padded) - 1)  # rank starts below ``unpadded``
    if shares > len(starts):
        return False
    step = padded // dp
    return all(r * step in starts for r in range(1, shares + 1))


def _divisors(n: int) -> Iterable[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]
