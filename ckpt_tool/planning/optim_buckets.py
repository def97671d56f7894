"""Where each parameter lies in the gradient buckets of Megatron-Core's DistributedOptimizer,
rebuilt from a checkpoint's metadata alone (pure; no I/O), and proven against what the
checkpoint stores (docs/formats.md §9).

In the ``dp_reshardable`` form the optimizer state is saved per DDP bucket: for the model-
parallel domain ``dp_group_idx`` (the rank in the tp × pp group: ``tp_rank + tp * pp_rank``),
buffer ``gbuf_idx`` (one per (param dtype, grad dtype)) and bucket ``bucket_idx``, the flat
tensors ``…bucket_idx_{b}.{param,exp_avg,exp_avg_sq}`` of ``numel_unpadded`` elements. DDP
(``distributed/param_and_grad_buffer.py`` of megatron-core 0.16) lays a buffer out by walking
the stage's parameters in *reverse* registration order: each parameter starts at a multiple of
64 elements; a bucket closes once it holds ``bucket_size`` elements (no size limit without
``overlap_grad_reduce`` and on pipeline stages after the first) or at a shared embedding; a
bucket's end is padded to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
``ddp_pad_buckets_for_high_nccl_busbw``).

The registration order of a GPT's parameters, dense and MoE, is data
(:mod:`ckpt_tool.planning.param_order`). MoE models at ``expert_model_parallel_size > 1`` have
two optimizers in a ``ChainedOptimizer`` whose keys carry ``chained_0.`` (dense buffers) and
``chained_1.`` (the routed experts' buffers: their own ``dp_group_idx``, padded and split over
the expert data-parallel size). With a virtual pipeline each optimizer has one buffer per model
chunk (``gbuf_idx`` counts them in chunk order) and, as Megatron-LM builds DDP
(``disable_bucketing`` for every chunk but the first), only each stage's first chunk is
bucketed. A rebuilt layout is accepted only when it reproduces
the stored ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` and the boundaries of every
stored piece (each parameter's part on each DP rank, and each padding, is its own chunk):
:mod:`ckpt_tool.planning.bucket_proof`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from ckpt_tool.model import CheckpointMeta, is_optimizer_key
from ckpt_tool.planning.layout import RuleSet, rule_for
from ckpt_tool.planning.param_order import (TIED_KEYS, model_key_prefix, moe_expert_keys,
                                            stage_params)
from ckpt_tool.planning.pieces import LocalTensor, rank_pieces
from ckpt_tool.planning.sizes import Layout, LayerMap, ModelSizes

__all__ = ["BucketParam", "Bucket", "BucketLayoutError",
           "BucketSizeUnknown", "UnknownParameterOrder", "optimizer_bucket_layout", "bucket_key", "bucket_size_configured",
           "configured_dp", "parallel_sizes", "STATES", "StoredBuckets", "BUCKET_KEY"]

STATES = ("param", "exp_avg", "exp_avg_sq")
BUCKET_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
                        r"gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.([a-z_0-9]+)$")


class BucketLayoutError(ValueError):
    """The rebuilt bucket layout does not match the checkpoint (message: where and how)."""


class UnknownParameterOrder(BucketLayoutError):
    """No known layer spec's registration order covers the model's parameters."""


class BucketSizeUnknown(BucketLayoutError):
    """Where DDP closed its buckets is neither configured nor stored."""


#: The stored ``per_bucket_numel_unpadded`` of each optimizer domain ``(prefix,
#: dp_group_idx)``: one list of bucket sizes per buffer (``gbuf_idx``).
StoredBuckets = Mapping[tuple[str, int], Sequence[Sequence[int]]]


@dataclass(frozen=True)
class BucketParam:
    """One parameter (one layer of a stacked key, one TP shard) in a bucket: elements
    ``[start, start + numel)`` of the bucket's flat tensors, ``local`` placing them in the
    global tensor."""

    key: str
    local: LocalTensor
    start: int
    numel: int
    #: the next component of the same parameter (stored per component: its elements follow
    #: the previous entry's with no boundary between them)
    continues: bool = False


@dataclass
class Bucket:
    """One DDP bucket of one model-parallel domain. ``prefix``: the ChainedOptimizer's
    ``chained_{i}.`` (empty for a single optimizer); ``dp``: the data-parallel size the bucket
    is padded and split over (the expert data-parallel size for expert buffers); ``ep_rank``:
    the expert-parallel rank of an expert buffer (None for dense buffers)."""

    dp_group_idx: int
    tp_rank: int
    pp_rank: int
    gbuf_idx: int
    dtype: str
    bucket_idx: int
    numel: int = 0
    numel_unpadded: int = 0
    params: list[BucketParam] = field(default_factory=list)
    prefix: str = ""
    dp: int = 0
    ep_rank: int | None = None

    def key(self, state: str) -> str:
        return bucket_key(self.dp_group_idx, self.gbuf_idx, self.dtype, self.bucket_idx, state,
                          self.prefix)

    @property
    def domain(self) -> tuple[str, int]:
        """``(prefix, dp_group_idx)``: which ``per_bucket_numel`` object describes it."""
        return self.prefix, self.dp_group_idx


def bucket_key(dp_group_idx: int, gbuf_idx: int, dtype: str, bucket_idx: int,
               state: str, prefix: str = "") -> str:
    """The stored key of one bucket's flat ``state`` tensor."""
    return (f"{prefix}optimizer.distributed.dp_group_idx_{dp_group_idx}.gbuf_idx_{gbuf_idx}."
            f"dtype_{dtype}.bucket_idx_{bucket_idx}.{state}")


def _model_keys(meta: CheckpointMeta) -> list[str]:
    return [k for k in meta.tensors if not is_optimizer_key(k)]


def bucket_size_configured(args: Mapping[str, Any]) -> bool:
    """Whether the configuration decides DDP's bucket size: Megatron-LM's
    ``overlap_grad_reduce`` (with ``ddp_bucket_size``; without it buckets are not split)."""
    return "overlap_grad_reduce" in args


_PARAM_ALIGN = 64  # DDP starts each parameter at a multiple of 64 elements


@dataclass(frozen=True)
class _Closing:
    """Where one buffer's buckets close: after ``size`` elements (None: never, a single
    bucket) and at a shared embedding, as DDP decides from its configuration; or, with
    ``stored`` (the buffer's ``per_bucket_numel_unpadded``), where the checkpoint says."""

    size: int | None = None
    stored: tuple[int, ...] | None = None

    def after(self, bucket: int, filled: int, shared: bool) -> bool:
        """Whether the bucket closes after a parameter that fills it to ``filled``."""
        if self.stored is not None:
            return bucket < len(self.stored) and filled >= self.stored[bucket]
        return (self.size is not None and filled >= self.size) or shared

    def before(self, bucket: int, filled: int, shared: bool) -> bool:
        """Whether the bucket closes before a parameter that would start at ``filled``
        (DDP: before a shared embedding; its unpadded size then ends at that start)."""
        if self.stored is not None:
            return bucket < len(self.stored) and filled == self.stored[bucket]
        return shared


def _closing(args: Mapping[str, Any], dp: int, pp_rank: int, bucketed: bool,
             stored: Sequence[int] | None, numels: Sequence[int]) -> _Closing:
    """How one buffer's buckets close; ``numels``: its parameters' sizes in layout order.
    Without a configured bucket size nor ``stored`` sizes, the buckets' unpadded ranges back
    to back (``dp_zero_gather_scatter``) place every parameter alike wherever the buckets
    close as long as no parameter start is padded (each size but the last a multiple of 64):
    one bucket then; else BucketSizeUnknown."""
    if not bucket_size_configured(args):
        if stored is not None:
            return _Closing(stored=tuple(int(n) for n in stored))
        if any(n % _PARAM_ALIGN for n in numels[:-1]):
            raise BucketSizeUnknown("the DDP bucket size is not in the checkpoint's "
                                    "configuration, this form stores no bucket sizes, and "
                                    "where buckets close moves the parameters (sizes not "
                                    f"multiples of {_PARAM_ALIGN})")
        return _Closing()
    if not bucketed or pp_rank > 0 or not args.get("overlap_grad_reduce"):
        return _Closing()
    size = args.get("ddp_bucket_size")
    return _Closing(int(size) if size else max(40_000_000, 1_000_000 * dp))


@dataclass(frozen=True)
class _Sizes:
    """The parallel sizes DDP and the optimizers were built with."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    edp: int
    divisor: Callable[[int], int]


def configured_dp(source: Layout, args: Mapping[str, Any]) -> int | None:
    """The data-parallel size the configuration gives (``data_parallel_size`` or
    ``world_size``), None when it gives none."""
    world = args.get("world_size")
    dp = int(args.get("data_parallel_size") or (int(world) // (source.tp * source.pp)
                                                 if world else 0))
    return dp or None


def parallel_sizes(source: Layout, args: Mapping[str, Any], dp: int | None) -> _Sizes:
    """The sizes DDP and the optimizers were built with: ``dp`` (else the configured one),
    the expert data-parallel size, the bucket padding divisor."""
    if int(args.get("context_parallel_size") or 1) > 1:
        raise BucketLayoutError("context parallelism: the bucket layout over the data-and-"
                                "context-parallel group is not rebuilt")
    dp = dp or configured_dp(source, args) or 0
    if dp < 1:
        raise BucketLayoutError("the data-parallel size is unknown (no args.data_parallel_size "
                                "or world_size)")
    world = dp * source.tp * source.pp
    etp = source.expert_tp
    if world % (etp * source.ep * source.pp):
        raise BucketLayoutError(f"world size {world} does not split into expert tp {etp} x "
                                f"ep {source.ep} x pp {source.pp}")
    edp = world // (etp * source.ep * source.pp)
    busbw = bool(args.get("ddp_pad_buckets_for_high_nccl_busbw"))
    return _Sizes(source.tp, source.pp, source.ep, etp, dp, edp,
                  lambda n: math.lcm(n, 128, 2 ** 16) if busbw else math.lcm(n, 128))


def optimizer_bucket_layout(meta: CheckpointMeta, sizes: ModelSizes, source: Layout,
                            args: Mapping[str, Any], rules: RuleSet | None = None,
                            spec: str | None = None, dtype: str | None = None,
                            stored: StoredBuckets | None = None,
                            dp: int | None = None) -> list[Bucket]:
    """Every bucket of every model-parallel domain, with its parameters, as DDP built them
    for the source layout. ``spec``: ``local`` / ``transformer_engine`` (default: from
    ``args.transformer_impl``, Megatron-LM's default being Transformer Engine). ``dtype``: the
    buffer's ``(param dtype, grad dtype)`` as Megatron-Core prints it (default: from the
    per-bucket tensor keys). ``dp``: the data-parallel size (default: from ``args``).

    Buckets close where the configuration's bucket size puts them (``args.overlap_grad_reduce``
    / ``ddp_bucket_size``); a configuration that does not say closes them at the ``stored``
    ``per_bucket_numel_unpadded`` (BucketSizeUnknown without them).

    MoE at ``ep > 1``: per stage the dense optimizer (``chained_0.``; domain
    ``tp_rank + tp * pp_rank``, padded over the data-parallel size) and the expert optimizer
    (``chained_1.``; domain ``etp_rank + etp * (ep_rank + ep * pp_rank)``, the rank in the
    expert tp-ep-pp group, padded over the expert data-parallel size); routed experts are
    placed contiguously by expert-parallel rank."""
    spec = spec or ("local" if args.get("transformer_impl") == "local" else "transformer_engine")
    vpp = source.vpp or 1
    if vpp > 1 and args.get("overlap_param_gather_with_optimizer_step"):
        raise BucketLayoutError("virtual pipeline with overlap_param_gather_with_optimizer_step: "
                                "one dense optimizer per model chunk is not rebuilt")
    if sizes.num_layers is None:
        raise BucketLayoutError("the number of layers is unknown (no args.num_layers)")
    ps = parallel_sizes(source, args, dp)
    # tied embeddings are DDP's "shared_embedding" (a bucket of their own) only at pp > 1
    tied = not args.get("untie_embeddings_and_output_weights", True) and ps.pp > 1
    dtype = dtype or _buffer_dtype(meta)
    rules = rules or RuleSet()
    lm = LayerMap(sizes.num_layers, source)
    model_keys = _model_keys(meta)
    experts = _expert_split(meta, sizes, ps, model_keys)
    prefix = model_key_prefix(model_keys)
    known = {k for p in range(ps.pp)
             for k, _l, _e in stage_params(model_keys, spec, lm.layers_of(p), p == 0,
                                           p == ps.pp - 1, experts[0], prefix)}
    unknown = [k for k in model_keys if k not in known]
    if unknown:
        raise UnknownParameterOrder(f"no parameter-order rule for {unknown[0]!r}"
                                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    expert_parallel = ps.ep > 1 and bool(experts[0])
    out: list[Bucket] = []
    for pp_rank in range(ps.pp):
        has_experts = expert_parallel and bool(lm.layers_of(pp_rank))
        gbufs: dict[tuple[str, int], int] = {}  # buffers so far per optimizer domain
        for vp in range(vpp):
            out += _chunk_buckets(meta, sizes, ps, spec, rules, lm, experts, pp_rank, vp, vpp,
                                  has_experts, dtype, tied, gbufs,
                                  lambda dp_, gbuf, domain, numels, vp=vp, pp_rank=pp_rank:
                                  _closing(args, dp_, pp_rank, vp == 0,
                                           None if stored is None else _stored_of(
                                               stored, domain, gbuf), numels))
    return out


def _stored_of(stored: StoredBuckets, domain: tuple[str, int], gbuf: int) -> Sequence[int]:
    buffers = stored.get(domain) or ()
    return buffers[gbuf] if gbuf < len(buffers) else ()


def _chunk_buckets(meta: CheckpointMeta, sizes: ModelSizes, ps: _Sizes, spec: str,
                   rules: RuleSet, lm: LayerMap, experts: list[list[int]], pp_rank: int, vp: int,
                   vpp: int, has_experts: bool, dtype: str, tied: bool,
                   gbufs: dict[tuple[str, int], int],
                   closing: Callable[[int, int, tuple[str, int], list[int]], _Closing]
                   ) -> list[Bucket]:
    """The buckets of one model chunk's buffers on every rank of pipeline stage ``pp_rank``
    (Megatron-LM buckets only each stage's first chunk: ``disable_bucketing`` for the
    others)."""
    layers = lm.layers_of(pp_rank, vp if vpp > 1 else None)
    first, last = pp_rank == 0 and vp == 0, pp_rank == ps.pp - 1 and vp == vpp - 1
    model_keys = _model_keys(meta)
    prefix = model_key_prefix(model_keys)
    out: list[Bucket] = []

    def add(template: Bucket, locals_: list[tuple[str, LocalTensor]], dp: int) -> None:
        if not locals_:  # DDP makes no buffer without parameters
            return
        gbuf = gbufs.get(template.domain, 0)
        gbufs[template.domain] = gbuf + 1
        numels = [math.prod(local.local_shape) for _k, local in reversed(locals_)]
        out.extend(_lay_out(replace(template, gbuf_idx=gbuf), locals_,
                            closing(ps.dp, gbuf, template.domain, numels), ps.divisor(dp),
                            tuple(prefix + k for k in TIED_KEYS) if tied else ()))

    dense = [p for p in stage_params(model_keys, spec, layers, first, last, experts[0], prefix)
             if not (has_experts and p[2] is not None)]
    for tp_rank in range(ps.tp):
        add(Bucket(tp_rank + ps.tp * pp_rank, tp_rank, pp_rank, 0, dtype, 0,
                   prefix="chained_0." if has_experts else "", dp=ps.dp),
            [_local(meta, k, layer, None if e is None else [e], sizes, ps.tp, tp_rank, rules)
             for k, layer, e in dense], ps.dp)
    if not has_experts:
        return out
    for ep_rank in range(ps.ep):
        mine = [p for p in stage_params(model_keys, spec, layers, first, last, experts[ep_rank],
                                        prefix)
                if p[2] is not None]
        for etp_rank in range(ps.etp):
            idx = etp_rank + ps.etp * (ep_rank + ps.ep * pp_rank)
            add(Bucket(idx, etp_rank, pp_rank, 0, dtype, 0, prefix="chained_1.", dp=ps.edp,
                       ep_rank=ep_rank),
                [_local(meta, k, layer, [e], sizes, ps.etp, etp_rank, rules)
                 for k, layer, e in mine], ps.edp)
    return out


def _expert_split(meta: CheckpointMeta, sizes: ModelSizes, ps: _Sizes,
                  model_keys: list[str]) -> list[list[int]]:
    """The global routed experts of each expert-parallel rank (``[[]]`` for a dense model)."""
    stacked = [k for k in moe_expert_keys(model_key_prefix(model_keys)) if k in meta.tensors]
    if not stacked:
        return [[] for _ in range(ps.ep)]
    counts = {meta.tensors[k].shape[1] for k in stacked}
    n = sizes.num_experts or next(iter(counts))
    if counts != {n}:
        raise BucketLayoutError(f"{stacked[0]}: {sorted(counts)} stacked experts, "
                                f"args.num_experts {sizes.num_experts}")
    if n % ps.ep:
        raise BucketLayoutError(f"{n} experts do not split over ep {ps.ep}")
    if ps.ep == 1 and ps.etp != ps.tp:
        raise BucketLayoutError(f"experts in the dense buffer (ep 1) with expert tp {ps.etp} "
                                f"!= tp {ps.tp}: not rebuilt")
    local = n // ps.ep
    return [list(range(r * local, (r + 1) * local)) for r in range(ps.ep)]


def _buffer_dtype(meta: CheckpointMeta) -> str:
    for k in meta.tensors:
        m = BUCKET_KEY.match(k)
        if m:
            return m.group(4)
    raise BucketLayoutError("no per-bucket optimizer tensors")


def _local(meta: CheckpointMeta, key: str, layer: int | None, experts: list[int] | None,
           sizes: ModelSizes, tp: int, tp_rank: int, rules: RuleSet) -> tuple[str, LocalTensor]:
    t = meta.tensors[key]
    rule = rule_for(key, rules)
    found = rank_pieces(key, t.shape, rule, tp=tp, tp_rank=tp_rank,
                        gated=sizes.gated_linear_unit,
                        layers=None if layer is None else [layer], experts=experts)
    if len(found) != 1:
        raise BucketLayoutError(f"{key}: expected one local tensor per layer, got {len(found)}")
    return key, found[0]


def _lay_out(template: Bucket, params: list[tuple[str, LocalTensor]], closing: _Closing,
             divisor: int, shared_keys: tuple[str, ...]) -> list[Bucket]:
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d

    buckets: list[Bucket] = []
    current = replace(template, params=[])
    bucket_start = start = end = 0

    def close(param_end: int) -> int:
        nonlocal current, bucket_start
        current.numel_unpadded = param_end - bucket_start
        bucket_end = pad(param_end, divisor)
        current.numel = bucket_end - bucket_start
        buckets.append(current)
        current = replace(template, bucket_idx=len(buckets), params=[])
        bucket_start = bucket_end
        return bucket_end

    for key, local in reversed(params):
        numel = math.prod(local.local_shape)
        start = pad(start, _PARAM_ALIGN)
        shared = key in shared_keys
        if current.params and closing.before(len(buckets), start - bucket_start, shared):
            start = close(start)
        end = start + numel
        current.params.append(BucketParam(key, local, start - bucket_start, numel))
        if closing.after(len(buckets), end - bucket_start, shared):
            start = close(end)
        else:
            start = end
    if current.params:
        close(end)
    return buckets
