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

The registration order of a GPT's parameters is data (:data:`GPT_PARAMETER_ORDER`), per
layer spec: the local spec registers ``input_layernorm`` (saved as
``linear_qkv.layer_norm_*``) before ``linear_proj``; Transformer-Engine layers fuse it into
``linear_qkv``, after ``linear_proj``. A rebuilt layout is accepted only when it reproduces
the stored ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` and the boundaries of every
stored piece (each parameter's part on each DP rank, and each padding, is its own chunk).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta
from ckpt_tool.planning.layout import RuleSet, rule_for
from ckpt_tool.planning.pieces import LocalTensor, rank_pieces
from ckpt_tool.planning.sizes import Layout, LayerMap, ModelSizes

__all__ = ["GPT_PARAMETER_ORDER", "BucketParam", "Bucket", "BucketLayoutError",
           "optimizer_bucket_layout", "prove_bucket_layout", "bucket_key", "STATES"]

STATES = ("param", "exp_avg", "exp_avg_sq")
_LAYER_PREFIX = "decoder.layers."
_ATTN_NORM = ["self_attention.linear_qkv.layer_norm_weight",
              "self_attention.linear_qkv.layer_norm_bias"]
_ATTN = ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
         "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias"]
_PROJ = ["self_attention.linear_proj.weight", "self_attention.linear_proj.bias"]
_MLP = ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
        "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
#: Parameter registration order of Megatron-Core's GPTModel, in saved (dist) key names:
#: ``first`` on the first pipeline stage, ``layer`` per transformer layer (suffixes of
#: ``decoder.layers.``), ``last`` on the last stage.
GPT_PARAMETER_ORDER: dict[str, dict[str, list[str]]] = {
    "local": {"first": ["embedding.word_embeddings.weight",
                        "embedding.position_embeddings.weight"],
              "layer": _ATTN_NORM + _PROJ + _ATTN + _MLP,
              "last": ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
                       "output_layer.weight"]},
    "transformer_engine": {"first": ["embedding.word_embeddings.weight",
                                     "embedding.position_embeddings.weight"],
                           "layer": _PROJ + _ATTN_NORM + _ATTN + _MLP,
                           "last": ["decoder.final_layernorm.weight",
                                    "decoder.final_layernorm.bias", "output_layer.weight"]},
}
_BUCKET_RE = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                        r"dtype_(.+)\.bucket_idx_(\d+)\.([a-z_0-9]+)$")


class BucketLayoutError(ValueError):
    """The rebuilt bucket layout does not match the checkpoint (message: where and how)."""


@dataclass(frozen=True)
class BucketParam:
    """One parameter (one layer of a stacked key, one TP shard) in a bucket: elements
    ``[start, start + numel)`` of the bucket's flat tensors, ``local`` placing them in the
    global tensor."""

    key: str
    local: LocalTensor
    start: int
    numel: int


@dataclass
class Bucket:
    """One DDP bucket of one model-parallel domain."""

    dp_group_idx: int
    tp_rank: int
    pp_rank: int
    gbuf_idx: int
    dtype: str
    bucket_idx: int
    numel: int = 0
    numel_unpadded: int = 0
    params: list[BucketParam] = field(default_factory=list)

    def key(self, state: str) -> str:
        return bucket_key(self.dp_group_idx, self.gbuf_idx, self.dtype, self.bucket_idx, state)


def bucket_key(dp_group_idx: int, gbuf_idx: int, dtype: str, bucket_idx: int,
               state: str) -> str:
    return (f"optimizer.distributed.dp_group_idx_{dp_group_idx}.gbuf_idx_{gbuf_idx}."
            f"dtype_{dtype}.bucket_idx_{bucket_idx}.{state}")


def _stage_params(meta: CheckpointMeta, spec: str, layers: Sequence[int], first: bool,
                  last: bool) -> list[tuple[str, int | None]]:
    order = GPT_PARAMETER_ORDER[spec]
    out: list[tuple[str, int | None]] = []
    if first:
        out += [(k, None) for k in order["first"] if k in meta.tensors]
    for layer in layers:
        out += [(_LAYER_PREFIX + s, layer) for s in order["layer"]
                if _LAYER_PREFIX + s in meta.tensors]
    if last:
        out += [(k, None) for k in order["last"] if k in meta.tensors]
    return out


def _model_keys(meta: CheckpointMeta) -> list[str]:
    return [k for k in meta.tensors if not k.startswith("optimizer.")]


def _bucket_size(args: Mapping[str, Any], dp: int, pp_rank: int) -> int | None:
    if pp_rank > 0 or not args.get("overlap_grad_reduce"):
        return None
    size = args.get("ddp_bucket_size")
    return int(size) if size else max(40_000_000, 1_000_000 * dp)


def optimizer_bucket_layout(meta: CheckpointMeta, sizes: ModelSizes, source: Layout,
                            args: Mapping[str, Any], rules: RuleSet | None = None,
                            spec: str | None = None, dtype: str | None = None) -> list[Bucket]:
    """Every bucket of every model-parallel domain, with its parameters, as DDP built them
    for the source layout. ``spec``: ``local`` / ``transformer_engine`` (default: from
    ``args.transformer_impl``, Megatron-LM's default being Transformer Engine). ``dtype``: the
    buffer's ``(param dtype, grad dtype)`` as Megatron-Core prints it (default: from the
    per-bucket tensor keys)."""
    spec = spec or ("local" if args.get("transformer_impl") == "local" else "transformer_engine")
    if source.vpp and source.vpp > 1:
        raise BucketLayoutError("virtual pipeline stages: the bucket layout of model chunks is "
                                "not rebuilt")
    if source.ep > 1 or sizes.num_experts:
        raise BucketLayoutError("expert-parallel buffers: the bucket layout of MoE models is "
                                "not rebuilt")
    if sizes.num_layers is None:
        raise BucketLayoutError("the number of layers is unknown (no args.num_layers)")
    world = args.get("world_size")
    dp = int(args.get("data_parallel_size") or (int(world) // (source.tp * source.pp)
                                                 if world else 0))
    if dp < 1:
        raise BucketLayoutError("the data-parallel size is unknown (no args.data_parallel_size "
                                "or world_size)")
    tied = not args.get("untie_embeddings_and_output_weights", True)
    divisor = math.lcm(dp, 128, 2 ** 16) if args.get(
        "ddp_pad_buckets_for_high_nccl_busbw") else math.lcm(dp, 128)
    dtype = dtype or _buffer_dtype(meta)
    rules = rules or RuleSet()
    lm = LayerMap(sizes.num_layers, source)
    known = {k for p in range(source.pp)
             for k, _l in _stage_params(meta, spec, lm.layers_of(p), p == 0,
                                        p == source.pp - 1)}
    unknown = [k for k in _model_keys(meta) if k not in known]
    if unknown:
        raise BucketLayoutError(f"no parameter-order rule for {unknown[0]!r}"
                                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    out: list[Bucket] = []
    for pp_rank in range(source.pp):
        params = _stage_params(meta, spec, lm.layers_of(pp_rank), pp_rank == 0,
                               pp_rank == source.pp - 1)
        for tp_rank in range(source.tp):
            idx = tp_rank + source.tp * pp_rank
            locals_ = [_local(meta, k, layer, sizes, source, tp_rank, rules) for k, layer in params]
            out += _lay_out(idx, tp_rank, pp_rank, dtype, locals_,
                            _bucket_size(args, dp, pp_rank), divisor, tied)
    return out


def _buffer_dtype(meta: CheckpointMeta) -> str:
    for k in meta.tensors:
        m = _BUCKET_RE.match(k)
        if m:
            return m.group(3)
    raise BucketLayoutError("no per-bucket optimizer tensors")


def _local(meta: CheckpointMeta, key: str, layer: int | None, sizes: ModelSizes, source: Layout,
           tp_rank: int, rules: RuleSet) -> tuple[str, LocalTensor]:
    t = meta.tensors[key]
    rule = rule_for(key, rules)
    found = rank_pieces(key, t.shape, rule, tp=source.tp, tp_rank=tp_rank,
                        gated=sizes.gated_linear_unit,
                        layers=None if layer is None else [layer])
    if len(found) != 1:
        raise BucketLayoutError(f"{key}: expected one local tensor per layer, got {len(found)}")
    return key, found[0]


def _lay_out(idx: int, tp_rank: int, pp_rank: int, dtype: str,
             params: list[tuple[str, LocalTensor]], bucket_size: int | None, divisor: int,
             tied: bool) -> list[Bucket]:
    def pad(n: int, d: int) -> int:
        return -(-n // d) * d

    buckets: list[Bucket] = []
    current = Bucket(idx, tp_rank, pp_rank, 0, dtype, 0)
    bucket_start = start = end = 0

    def close(param_end: int) -> int:
        nonlocal current, bucket_start
        current.numel_unpadded = param_end - bucket_start
        bucket_end = pad(param_end, divisor)
        current.numel = bucket_end - bucket_start
        buckets.append(current)
        current = Bucket(idx, tp_rank, pp_rank, 0, dtype, len(buckets))
        bucket_start = bucket_end
        return bucket_end

    for key, local in reversed(params):
        numel = math.prod(local.local_shape)
        start = pad(start, 64)
        shared = tied and key in ("embedding.word_embeddings.weight", "output_layer.weight")
        if shared and current.params:
            start = close(start)
        end = start + numel
        current.params.append(BucketParam(key, local, start - bucket_start, numel))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if current.params:
        close(end)
    return buckets


def prove_bucket_layout(buckets: Sequence[Bucket], meta: CheckpointMeta,
                        per_bucket: Mapping[int, tuple[Any, Any]], dp: int) -> list[str]:
    """Every disagreement between the rebuilt ``buckets`` and the checkpoint: the stored
    ``per_bucket_numel`` / ``per_bucket_numel_unpadded`` (``per_bucket[dp_group_idx]``, as
    saved: a list over buffers of ``{(param dtype, grad dtype): [numel, ...]}``), the bucket
    tensors' keys and lengths, and the chunk boundaries of each bucket tensor."""
    problems: list[str] = []
    by_group: dict[int, list[Bucket]] = {}
    for b in buckets:
        by_group.setdefault(b.dp_group_idx, []).append(b)
    stored_keys = {k for k in meta.tensors if _BUCKET_RE.match(k)}
    expected_keys = {b.key(s) for b in buckets for s in STATES}
    if stored_keys - expected_keys:
        problems.append(f"{plural(len(stored_keys - expected_keys), 'stored bucket tensor')} "
                        "not in the "
                        f"rebuilt layout, e.g. {sorted(stored_keys - expected_keys)[0]}")
    for idx, group in sorted(by_group.items()):
        if idx not in per_bucket:
            problems.append(f"dp_group_idx_{idx}: per_bucket_numel is missing")
            continue
        numel, unpadded = (_flat_numels(v) for v in per_bucket[idx])
        want = [b.numel for b in group], [b.numel_unpadded for b in group]
        if (numel, unpadded) != want:
            problems.append(f"dp_group_idx_{idx}: rebuilt buckets of {want[0]} elements "
                            f"({want[1]} unpadded), stored per_bucket_numel {numel} "
                            f"({unpadded} unpadded)")
            continue
        for b in group:
            problems += _prove_chunks(b, meta, dp)
    return problems


def _flat_numels(value: Any) -> list[int]:
    out: list[int] = []
    for per_dtype in value or []:
        for numels in dict(per_dtype).values():
            out += [int(n) for n in numels]
    return out


def _prove_chunks(b: Bucket, meta: CheckpointMeta, dp: int) -> list[str]:
    local = b.numel // dp
    points = {0} | {r * local for r in range(dp)}
    for p in b.params:
        points |= {p.start, p.start + p.numel}
    want = sorted(x for x in points if x < b.numel_unpadded)
    out = []
    for state in STATES:
        t = meta.tensors.get(b.key(state))
        if t is None:
            out.append(f"{b.key(state)}: missing")
            continue
        if tuple(t.shape) != (b.numel_unpadded,):
            out.append(f"{b.key(state)}: {list(t.shape)} stored, {b.numel_unpadded} rebuilt")
            continue
        got = sorted(c.offsets[0] for c in t.chunks)
        if got != want:
            diff = sorted(set(got) ^ set(want))
            out.append(f"{b.key(state)}: stored pieces start at {len(got)} offsets, the rebuilt "
                       f"layout at {len(want)} (first difference at element {diff[0]})")
    return out
