"""Where each parameter lies in the DistributedOptimizer's buckets, read off the stored data
when no known registration order places it (pure; the reads are the caller's).

A known layer spec gives the order in which a model registers its parameters
(:mod:`ckpt_tool.planning.param_order`), and DDP lays its buffers out from it. For any other
model the order is derived, bucket by bucket, from what a ``dp_reshardable`` checkpoint stores
(docs/optimizer.md, "Any architecture"):

* the buffer's parameters are the stage's model tensors of the buffer's dtype (routed experts in
  the expert buffers at ``ep > 1``), one per stacked layer and expert, each the local tensor of
  the domain's tensor-parallel rank (:func:`buffer_candidates`);
* DDP starts each parameter at a multiple of 64 elements of its bucket and each parameter's part
  on each data-parallel rank, and each padding, is a stored piece: walking a bucket from its
  start, the parameter at element ``s`` ends where a stored piece starts (or at the bucket's
  unpadded end); the candidates whose size ends there are the ones that may lie there;
* of those, the one whose stored weight equals the bucket's fp32 main parameter at ``s`` cast to
  the model's dtype (DistributedOptimizer copies it so after every step) is the one that lies
  there (``match``, the caller's reads).

Candidates with bit-identical weights may swap places only where that moves nothing: the slots
they take must hold identical state (``same``), else the placement is refused naming them
(:class:`AmbiguousPlacement`). A stored model tensor that no bucket holds is a buffer, not a
parameter (the router's ``expert_bias``): it is reported, never placed. The placement is then
proven like any rebuilt layout (:mod:`ckpt_tool.planning.bucket_proof`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta, is_optimizer_key
from ckpt_tool.planning.grid import infer_rule_from_grid
from ckpt_tool.planning.layout import RuleSet, leading_axes, stacked_expert_axis
from ckpt_tool.planning.optim_buckets import (Bucket, BucketLayoutError, BucketParam,
                                              parallel_sizes)
from ckpt_tool.planning.param_order import (COMPONENTS, NOT_PARAMETERS, TIED_KEYS,
                                            model_key_prefix)
from ckpt_tool.planning.pieces import LocalTensor, rank_pieces
from ckpt_tool.planning.sizes import Layout, LayerMap, ModelSizes

__all__ = ["Candidate", "BufferToPlace", "AmbiguousPlacement", "buffer_candidates",
           "place_buffer", "placed_order", "Match", "Same"]

_PARAM_ALIGN = 64
_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
_STACKED_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(?!\d)")
_FIRST_STAGE = re.compile(r"(?:^|\.)embedding\.")
_MTP = re.compile(r"(?:^|\.)mtp\.")
_EXPERT_NUMBER = re.compile(r"experts\.(?:local_experts\.)?(\d+)\.|linear_fc\d\.(?:weight|bias)(\d+)$")


class AmbiguousPlacement(BucketLayoutError):
    """Parameters with identical weights whose bucket slots hold different optimizer state:
    the stored data cannot say which is which."""


@dataclass(frozen=True)
class Candidate:
    """One parameter that may lie in a buffer: one layer of a stacked key, one expert, the
    local tensor of one tensor-parallel rank."""

    key: str
    layer: int | None
    expert: int | None
    local: LocalTensor
    #: a parameter stored per component (param_order.COMPONENTS): each component's key and
    #: local tensor, in the order they are concatenated (``key``/``local``: the first's)
    parts: tuple[tuple[str, LocalTensor], ...] = ()

    @property
    def pieces(self) -> tuple[tuple[str, LocalTensor], ...]:
        """``(key, local tensor)`` of each stored key the parameter is made of, in order."""
        return self.parts or ((self.key, self.local),)

    @property
    def numel(self) -> int:
        return sum(math.prod(local.local_shape) for _k, local in self.pieces)

    def bucket_params(self, start: int) -> list[BucketParam]:
        """The parameter at element ``start`` of a bucket: one entry per stored key."""
        out = []
        for key, local in self.pieces:
            n = math.prod(local.local_shape)
            out.append(BucketParam(key, local, start, n, continues=bool(out)))
            start += n
        return out

    @property
    def name(self) -> str:
        where = [f"layer {self.layer}"] if self.layer is not None and \
            _STACKED_LAYER.search(self.key) else []
        where += [f"expert {self.expert}"] if self.expert is not None else []
        return self.key + (f" ({', '.join(where)})" if where else "")


@dataclass
class BufferToPlace:
    """One DDP buffer of one optimizer domain: ``template`` (its domain, ``gbuf_idx``, dtype
    and data-parallel size), the parameters that may lie in it, and per bucket the stored
    ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` and the starts of the stored pieces
    of its ``param`` tensor."""

    template: Bucket
    candidates: list[Candidate]
    padded: list[int]
    unpadded: list[int]
    starts: list[set[int]]


#: ``match(bucket, start, candidates)``: those of ``candidates`` whose stored weight equals the
#: bucket's main parameter at element ``start`` (``candidate.numel`` elements) cast to the
#: model's dtype.
Match = Callable[[Bucket, int, list[Candidate]], list[Candidate]]
#: ``same(slots)``: whether the ``(bucket, start, numel)`` slots hold identical state.
Same = Callable[[list[tuple[Bucket, int, int]]], bool]


def _rule(meta: CheckpointMeta, key: str, rules: RuleSet, tp: int) -> Any:
    rule = rules.find(key)
    if rule is None or rule.grid_first:
        rule = infer_rule_from_grid(meta.tensors[key], tp) or rule
    if rule is None:
        raise BucketLayoutError(f"no layout rule knows how {key!r} splits across "
                                "tensor-parallel ranks, and its chunk grid cannot tell")
    return rule


def buffer_candidates(meta: CheckpointMeta, sizes: ModelSizes, source: Layout,
                      args: Mapping[str, Any], rules: RuleSet, dp: int,
                      buffers: Mapping[tuple[str, int], Sequence[str]]
                      ) -> dict[tuple[str, int, int], list[Candidate]]:
    """The parameters that may lie in each stored buffer ``(prefix, dp_group_idx, gbuf_idx)``
    (``buffers``: each optimizer domain's buffer dtypes, ``(param dtype, grad dtype)`` as
    Megatron-Core prints them, in ``gbuf_idx`` order). One model chunk per stage (a virtual
    pipeline is not derived)."""
    if (source.vpp or 1) > 1:
        raise BucketLayoutError("virtual pipeline: the parameter order is not derived from the "
                                "stored data for more than one model chunk per stage")
    if sizes.num_layers is None:
        raise BucketLayoutError("the number of layers is unknown (no args.num_layers)")
    ps = parallel_sizes(source, args, dp)
    lm = LayerMap(sizes.num_layers, source)
    keys = [k for k, t in meta.tensors.items() if not is_optimizer_key(k)
            and not any(re.search(p, k) for p in NOT_PARAMETERS)]
    prefix = model_key_prefix(keys)
    tied = prefix + TIED_KEYS[0] in meta.tensors and prefix + TIED_KEYS[1] not in meta.tensors
    mtp = any(_MTP.search(k) for k in keys)
    expert_keys = {k for k in keys if _rule(meta, k, rules, ps.tp).expert}
    expert_parallel = ps.ep > 1 and bool(expert_keys)
    out: dict[tuple[str, int, int], list[Candidate]] = {}
    for pp_rank in range(ps.pp):
        layers = lm.layers_of(pp_rank)
        first, last = pp_rank == 0, pp_rank == ps.pp - 1
        for key in keys:
            if not _on_stage(key, layers, first, last, ps.pp > 1 and (tied or mtp)):
                continue
            t = meta.tensors[key]
            rule = _rule(meta, key, rules, ps.tp)
            expert = key in expert_keys
            if expert and expert_parallel:
                for ep_rank in range(ps.ep):
                    for etp_rank in range(ps.etp):
                        idx = etp_rank + ps.etp * (ep_rank + ps.ep * pp_rank)
                        found = _locals(key, t.shape, rule, ps.etp, etp_rank, layers,
                                        _experts_of(key, t.shape, rule, ep_rank, ps.ep))
                        _add(out, buffers, ("chained_1.", idx), t.dtype, found)
                continue
            for tp_rank in range(ps.tp):
                idx = tp_rank + ps.tp * pp_rank
                tp, r = (ps.etp, tp_rank) if expert else (ps.tp, tp_rank)
                found = _locals(key, t.shape, rule, tp, r, layers,
                                _experts_of(key, t.shape, rule, 0, 1) if expert else None)
                _add(out, buffers, ("chained_0." if expert_parallel else "", idx), t.dtype,
                     found)
    return {k: _join_components(v) for k, v in out.items()}


def _join_components(found: list[Candidate]) -> list[Candidate]:
    """Candidates of one buffer with each parameter stored per component made one."""
    groups: dict[tuple[str, int | None, int | None], dict[str, Candidate]] = {}
    out: list[Candidate] = []
    for c in found:
        for base, parts in COMPONENTS.items():
            m = re.search(rf"(^|\.){base}\.([^.]+)$", c.key)
            if m and m.group(2) in parts:
                groups.setdefault((c.key[:m.start(2) - 1], c.layer, c.expert), {})[
                    m.group(2)] = c
                break
        else:
            out.append(c)
    for (base_key, layer, expert), by_part in groups.items():
        order = next(parts for base, parts in COMPONENTS.items()
                     if re.search(rf"(^|\.){base}$", base_key))
        if set(by_part) != set(order):
            raise BucketLayoutError(f"{base_key}: stored components {sorted(by_part)}, a "
                                    f"parameter of components {list(order)}")
        first = by_part[order[0]]
        out.append(Candidate(first.key, layer, expert, first.local,
                             tuple((by_part[p].key, by_part[p].local) for p in order)))
    return out


def _on_stage(key: str, layers: Sequence[int], first: bool, last: bool,
              shared_embedding: bool) -> bool:
    """Whether pipeline stage (``layers``, ``first``, ``last``) holds ``key``: its layers'
    keys, the embedding on the first stage (and on the last where it is shared with the output
    layer or the MTP layers), everything else on the last stage."""
    m = _LAYER.search(key)
    if m:
        return int(m.group(1)) in layers
    if _STACKED_LAYER.search(key):
        return bool(layers)
    if _FIRST_STAGE.search(key):
        return first or (last and shared_embedding and key.endswith(TIED_KEYS[0]))
    return last


def _experts_of(key: str, shape: Sequence[int], rule: Any, ep_rank: int,
                ep: int) -> list[int] | None:
    """The global experts of expert-parallel rank ``ep_rank`` that ``key`` holds: a range of
    its stacked expert axis, or the expert numbered in the key (None: every expert)."""
    if stacked_expert_axis(key, rule):
        n = shape[leading_axes(key, len(shape), rule) - 1]
        if n % ep:
            raise BucketLayoutError(f"{key}: {n} experts do not split over ep {ep}")
        return list(range(ep_rank * n // ep, (ep_rank + 1) * n // ep))
    return None


def _locals(key: str, shape: Sequence[int], rule: Any, tp: int, tp_rank: int,
            layers: Sequence[int], experts: list[int] | None) -> list[Candidate]:
    m = _LAYER.search(key)
    numbered = _EXPERT_NUMBER.search(key) if rule.expert else None
    found = rank_pieces(key, shape, rule, tp=tp, tp_rank=tp_rank,
                        layers=None if m else list(layers), experts=experts)
    out = []
    for local in found:
        layer = int(m.group(1)) if m else None
        expert = None
        lead = leading_axes(key, len(shape), rule)
        offsets = local.pieces[0].global_offsets if local.pieces else ()
        if not m and _STACKED_LAYER.search(key) and lead:
            layer = offsets[0]
        if experts is not None and lead:
            expert = offsets[lead - 1]
        elif numbered:
            expert = int(numbered.group(1) or numbered.group(2))
        out.append(Candidate(key, layer, expert, local))
    return out


def _add(out: dict[tuple[str, int, int], list[Candidate]],
         buffers: Mapping[tuple[str, int], Sequence[str]], domain: tuple[str, int], dtype: str,
         found: list[Candidate]) -> None:
    """Into the domain's buffer of ``dtype`` (a parameter of a dtype no buffer has is not a
    parameter of this optimizer: skipped)."""
    for gbuf, buffer_dtype in enumerate(buffers.get(domain, ())):
        if _param_dtype(buffer_dtype) == dtype:
            out.setdefault((domain[0], domain[1], gbuf), []).extend(found)
            return


def _param_dtype(buffer_dtype: str) -> str:
    """``bfloat16`` of ``(torch.bfloat16, torch.float32)``."""
    first = buffer_dtype.strip("()").split(",")[0].strip()
    return first.removeprefix("torch.")


def placed_order(buckets: Sequence[Bucket], candidates: Sequence[Candidate]
                 ) -> list[list[tuple[str, int | None, int | None]]]:
    """Per bucket, the ``(key, layer, expert)`` of each placed parameter: what the other
    tensor-parallel ranks of the same stage follow (:func:`place_buffer` ``follow``)."""
    ident = {(k, local): (c.key, c.layer, c.expert) for c in candidates
             for k, local in c.pieces}
    out = []
    for b in buckets:
        order: list[tuple[str, int | None, int | None]] = []
        for p in b.params:
            i = ident[(p.key, p.local)]
            if not order or order[-1] != i or not any(c.parts for c in candidates
                                                      if (c.key, c.layer, c.expert) == i):
                order.append(i)
        out.append(order)
    return out


def place_buffer(buf: BufferToPlace, match: Match, same: Same,
                 follow: Sequence[Sequence[tuple[str, int | None, int | None]]] | None = None
                 ) -> tuple[list[Bucket], list[Candidate]]:
    """The buffer's buckets with every parameter placed (module docstring), and the candidates
    no bucket holds. BucketLayoutError naming the first slot nothing fits or matches;
    AmbiguousPlacement naming parameters the stored data cannot tell apart.

    ``follow``: the order placed on tensor-parallel rank 0 of the same stage (a model registers
    its parameters alike on every rank; the copies of a replicated parameter on other ranks
    need not equal the stored one, which is rank 0's): each parameter is taken in that order
    and only its fit to the stored pieces is checked."""
    if follow is not None:
        return _follow(buf, follow)
    where = f"{buf.template.prefix}dp_group_idx_{buf.template.dp_group_idx} " \
            f"buffer {buf.template.gbuf_idx}"
    remaining = sorted(buf.candidates, key=lambda c: (c.key, c.layer or 0, c.expert or 0))
    buckets: list[Bucket] = []
    taken: dict[int, Candidate] = {}  # id(candidate) -> candidate, for the groups below
    groups: list[tuple[set[int], list[tuple[Bucket, int, int]]]] = []
    for b, (padded, unpadded, starts) in enumerate(zip(buf.padded, buf.unpadded, buf.starts)):
        bucket = replace(buf.template, bucket_idx=b, numel=padded, numel_unpadded=unpadded,
                         params=[])
        ends = set(starts) | {unpadded}
        pos = 0
        while pos < unpadded:
            fitting = [c for c in remaining if pos + c.numel in ends]
            if not fitting:
                raise BucketLayoutError(f"{where} bucket {b}: no parameter of the model ends "
                                        f"at a stored piece boundary from element {pos}")
            matched = match(bucket, pos, fitting)
            if not matched:
                raise BucketLayoutError(f"{where} bucket {b}: the main parameter at element "
                                        f"{pos} equals none of the "
                                        f"{plural(len(fitting), 'parameter')} of its size "
                                        f"(e.g. {fitting[0].name})")
            chosen = matched[0]
            if len(matched) > 1 or any(id(c) in g for g, _s in groups for c in matched):
                _join(groups, {id(c) for c in matched}, (bucket, pos, chosen.numel))
            remaining.remove(chosen)
            taken[id(chosen)] = chosen
            bucket.params.extend(chosen.bucket_params(pos))
            end = pos + chosen.numel
            pos = min(-(-end // _PARAM_ALIGN) * _PARAM_ALIGN, unpadded) if end < unpadded \
                else unpadded
        buckets.append(bucket)
    for ids, slots in groups:
        if len(slots) > 1 and not same(slots):
            names = sorted(taken[i].name for i in ids if i in taken)
            raise AmbiguousPlacement(
                f"{where}: {plural(len(names), 'parameter')} with identical weights and "
                f"different optimizer state ({', '.join(names[:4])}"
                + (", ..." if len(names) > 4 else "") + "): the stored data does not say "
                "which is which")
    return buckets, remaining


def _join(groups: list[tuple[set[int], list[tuple[Bucket, int, int]]]], ids: set[int],
          slot: tuple[Bucket, int, int]) -> None:
    """Add ``slot`` to the group of candidates with identical weights that ``ids`` meets."""
    for g, slots in groups:
        if g & ids:
            g |= ids
            slots.append(slot)
            return
    groups.append((set(ids), [slot]))


def _follow(buf: BufferToPlace, follow: Sequence[Sequence[tuple[str, int | None, int | None]]]
            ) -> tuple[list[Bucket], list[Candidate]]:
    where = f"{buf.template.prefix}dp_group_idx_{buf.template.dp_group_idx} " \
            f"buffer {buf.template.gbuf_idx}"
    by_ident = {(c.key, c.layer, c.expert): c for c in buf.candidates}
    if len(follow) != len(buf.unpadded):
        raise BucketLayoutError(f"{where}: {len(buf.unpadded)} buckets stored, "
                                f"{len(follow)} on tensor-parallel rank 0")
    buckets: list[Bucket] = []
    for b, (padded, unpadded, starts, order) in enumerate(
            zip(buf.padded, buf.unpadded, buf.starts, follow)):
        bucket = replace(buf.template, bucket_idx=b, numel=padded, numel_unpadded=unpadded,
                         params=[])
        ends = set(starts) | {unpadded}
        pos = 0
        for ident in order:
            c = by_ident.pop(ident, None)
            if c is None or pos + c.numel not in ends:
                raise BucketLayoutError(f"{where} bucket {b}: the order of tensor-parallel "
                                        f"rank 0 does not fit the stored pieces at element "
                                        f"{pos} ({ident[0]})")
            bucket.params.extend(c.bucket_params(pos))
            end = pos + c.numel
            pos = min(-(-end // _PARAM_ALIGN) * _PARAM_ALIGN, unpadded) if end < unpadded \
                else unpadded
        if pos != unpadded:
            raise BucketLayoutError(f"{where} bucket {b}: the order of tensor-parallel rank 0 "
                                    f"ends at element {pos}, the bucket at {unpadded}")
        buckets.append(bucket)
    return buckets, list(by_ident.values())
