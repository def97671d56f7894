"""The bucket layout of ``dp_reshardable`` optimizer state read off the stored data, for models
whose parameter registration order no known layer spec gives (MLA, MTP, grouped-GEMM experts,
hybrid and other families): :mod:`ckpt_tool.planning.param_placement` walks each bucket; this
module does its reads. A slot's fp32 main parameter, cast to the model's dtype, is compared with
the stored weights of the parameters that fit there (digests of their bytes, each weight read
once); slots that parameters with identical weights could swap are compared state by state.

Cost: every model weight and every main parameter of the source is read once (about 3/7 of a
checkpoint with bf16 weights and Adam state), in pieces of one parameter shard.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any, Mapping

from ckpt_tool.errors import plural
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.planning.bucket_choices import stored_bucket_sizes
from ckpt_tool.planning.layout import RuleSet
from ckpt_tool.planning.optim_buckets import (BUCKET_KEY, STATES, Bucket, BucketLayoutError,
                                              parallel_sizes)
from ckpt_tool.planning.param_placement import (BufferToPlace, Candidate, buffer_candidates,
                                                place_buffer, placed_order)
from ckpt_tool.planning.pieces import LocalTensor
from ckpt_tool.planning.sizes import Layout, ModelSizes

__all__ = ["derive_bucket_layout", "describe_leftover"]

Domain = tuple[str, int]


def derive_bucket_layout(reader: Reader, meta: CheckpointMeta, sizes: ModelSizes,
                         source: Layout, args: Mapping[str, Any], rules: RuleSet | None,
                         per_bucket: Mapping[Domain, tuple[Any, Any]], dp: int
                         ) -> tuple[list[Bucket], list[Candidate]]:
    """Every bucket of every stored buffer with its parameters placed from the stored data,
    and the stored model tensors no bucket holds (BucketLayoutError where the data does not
    place a parameter, naming it)."""
    rules = rules or RuleSet()
    buffers = _stored_buffers(meta)
    padded = stored_bucket_sizes(per_bucket, 0)
    unpadded = stored_bucket_sizes(per_bucket, 1)
    ps = parallel_sizes(source, args, dp)
    candidates = buffer_candidates(meta, sizes, source, args, rules, dp,
                                   {d: [dt for _g, dt in sorted(b.items())]
                                    for d, b in buffers.items()})
    reads = _Reads(reader, meta)
    out: list[Bucket] = []
    leftover: list[Candidate] = []
    orders: dict[tuple[str, int, int], Any] = {}  # (prefix, group of tp rank 0, gbuf)
    for (prefix, idx), by_gbuf in sorted(buffers.items()):
        expert = prefix == "chained_1."
        tp = ps.etp if expert else ps.tp
        for gbuf, dtype in sorted(by_gbuf.items()):
            sizes_p = _at(padded, (prefix, idx), gbuf)
            sizes_u = _at(unpadded, (prefix, idx), gbuf)
            if len(sizes_p) != len(sizes_u) or not sizes_u:
                raise BucketLayoutError(f"{prefix}dp_group_idx_{idx} buffer {gbuf}: "
                                        "per_bucket_numel is missing or does not match "
                                        "per_bucket_numel_unpadded")
            template = Bucket(idx, idx % (ps.etp if expert else ps.tp),
                              idx // ((ps.etp * ps.ep) if expert else ps.tp), gbuf, dtype, 0,
                              prefix=prefix, dp=ps.edp if expert else ps.dp,
                              ep_rank=(idx // ps.etp) % ps.ep if expert else None)
            starts = [{c.offsets[0] for c in meta.tensors[_bucket_key(template, b)].chunks}
                      if _bucket_key(template, b) in meta.tensors else set()
                      for b in range(len(sizes_u))]
            buf = BufferToPlace(template, candidates.get((prefix, idx, gbuf), []), sizes_p,
                                sizes_u, starts)
            rank0 = (prefix, idx - idx % tp, gbuf)
            buckets, rest = place_buffer(buf, reads.match, reads.same, orders.get(rank0))
            if idx % tp == 0:
                orders[rank0] = placed_order(buckets, buf.candidates)
            out += buckets
            leftover += rest
    return out, leftover


def _bucket_key(template: Bucket, b: int) -> str:
    return replace(template, bucket_idx=b).key("param")


def _at(stored: Mapping[Domain, list[list[int]]], domain: Domain, gbuf: int) -> list[int]:
    buffers = stored.get(domain) or []
    return list(buffers[gbuf]) if gbuf < len(buffers) else []


def _stored_buffers(meta: CheckpointMeta) -> dict[Domain, dict[int, str]]:
    """Each optimizer domain's buffers: ``gbuf_idx`` -> dtype string, from the bucket keys."""
    out: dict[Domain, dict[int, str]] = {}
    for k in meta.tensors:
        m = BUCKET_KEY.match(k)
        if m:
            out.setdefault((m.group(1) or "", int(m.group(2))), {})[int(m.group(3))] = m.group(4)
    return out


class _Reads:
    """The reads and comparisons of the placement: digests of each candidate's stored weight
    (its local tensor, one read per piece) and of each slot's main parameter cast to the
    model's dtype."""

    def __init__(self, reader: Reader, meta: CheckpointMeta):
        self.reader, self.meta = reader, meta
        self._weights: dict[tuple[str, tuple], bytes] = {}

    def _weight_digest(self, c: Candidate) -> bytes:
        ident = tuple((k, tuple((p.global_offsets, p.sizes) for p in local.pieces))
                      for k, local in c.pieces)
        if ident not in self._weights:
            self._weights[ident] = _digest(*(self._local(k, local) for k, local in c.pieces))
        return self._weights[ident]

    def _local(self, key: str, local: LocalTensor) -> Any:
        import torch

        out = None
        for piece in local.pieces:
            if piece.fill is not None:
                raise BucketLayoutError(f"{key}: a local tensor beyond the stored rows")
            part = self.reader.read(key, tuple(slice(o, o + n) for o, n in
                                               zip(piece.global_offsets, piece.sizes)))
            if out is None:
                out = torch.empty(local.local_shape, dtype=part.dtype)
            out[tuple(slice(o, o + n) for o, n in zip(piece.local_offsets, piece.sizes))] = part
        return out

    def _slot(self, bucket: Bucket, state: str, start: int, numel: int) -> Any:
        return self.reader.read(bucket.key(state), (slice(start, start + numel),))

    def match(self, bucket: Bucket, start: int, fitting: list[Candidate]) -> list[Candidate]:
        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

        slots: dict[tuple[int, str], bytes] = {}
        out = []
        for c in fitting:
            dtype = self.meta.tensors[c.key].dtype  # (a parameter's components share it)
            if (c.numel, dtype) not in slots:
                main = self._slot(bucket, "param", start, c.numel)
                slots[(c.numel, dtype)] = _digest(main.to(torch_dtype(dtype)))
            if slots[(c.numel, dtype)] == self._weight_digest(c):
                out.append(c)
        return out

    def same(self, slots: list[tuple[Bucket, int, int]]) -> bool:
        import torch

        for state in STATES:
            first = None
            for bucket, start, numel in slots:
                got = self._slot(bucket, state, start, numel)
                if first is None:
                    first = got
                elif got.shape != first.shape or not torch.equal(got, first):
                    return False
        return True


def _digest(*tensors: Any) -> bytes:
    """One digest of the bytes of ``tensors``, one after the other."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for t in tensors:  # the tensor's own buffer: a copy (tobytes) costs as much as the hash
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def describe_leftover(leftover: list[Candidate]) -> str:
    """A few words on the stored model tensors no bucket holds (not parameters)."""
    keys = sorted({c.key for c in leftover})
    if not keys:
        return ""
    return (f"{plural(len(keys), 'stored model tensor')} in no bucket (not trained by this "
            f"optimizer: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
