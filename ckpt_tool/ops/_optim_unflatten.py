"""The DistributedOptimizer's bucket-space state (``dp_reshardable``) seen in model space.

:class:`UnflattenedOptimizerView` wraps a Megatron-Core dist reader whose optimizer state is
stored per gradient bucket and presents it as Megatron-Core's ``fully_reshardable`` form:
``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`` tensors with the model tensors'
global shapes, the common state's ``optimizer`` entry (param groups, ``param_state_sharding_type``)
and the content metadata saying ``fully_reshardable``; the per-bucket tensors and objects are
gone. Any reshard plan then moves that state with the model. The bucket layout comes from
:mod:`ckpt_tool.planning.optim_buckets` and must be proven first; a read pulls one parameter's
elements of one bucket at a time (memory: the largest parameter shard).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import replace
from typing import Any

from ckpt_tool.errors import UnsupportedError, plural
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, split_chained
from ckpt_tool.ops._optim_model_space import _MAIN_0_15, ModelSpaceDistOptimizerView
from ckpt_tool.planning.source_model import model_sizes_from
from ckpt_tool.planning.source_layout import args_of, source_layout_from
from ckpt_tool.planning.layout import RuleSet
from ckpt_tool.planning.optim_buckets import (STATES, Bucket, BucketLayoutError, BucketParam,
                                              optimizer_bucket_layout, prove_bucket_layout)
from ckpt_tool.planning.param_order import moe_expert_keys
from ckpt_tool.planning.pieces import Piece

__all__ = ["UnflattenedOptimizerView", "GatheredOptimizerView", "ModelSpaceDistOptimizerView",
           "unflatten_bucketed_optimizer"]

_GROUP = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
                    r"(per_bucket_numel|per_bucket_numel_unpadded|optimizer|param_state)$")
Domain = tuple[str, int]  # (chained prefix, dp_group_idx)


def unflatten_bucketed_optimizer(reader: Reader, rules: RuleSet | None = None) -> Reader:
    """``reader`` itself unless it holds ``dp_reshardable`` optimizer state; then the proven
    model-space view (UnsupportedError, exit 2, naming what does not match, when the layout
    cannot be rebuilt or proven)."""
    meta = reader.metadata()
    found = meta.extras.get("optimizer_sharding") or {}
    _refuse_unknown_forms(meta, found)
    if found.get("type") == "dp_reshardable":
        return UnflattenedOptimizerView(reader, rules)
    if found.get("type") == "dp_zero_gather_scatter":
        return GatheredOptimizerView(reader, rules)
    if found.get("type") == "fully_sharded_model_space":
        return ModelSpaceDistOptimizerView(
            reader, "converted from fully_sharded_model_space (flattened, read in model space)")
    if meta.format == "legacy" and any(o.key == "distrib_optim" for o in meta.objects) and any(
            k.startswith(_MAIN_0_15) for k in meta.tensors):
        return ModelSpaceDistOptimizerView(
            reader, "converted from legacy distrib_optim.pt (model space per parameter)",
            drop_objects=("distrib_optim", "optimizer"))
    return reader


# distrib_optim_sharding_type values Megatron-Core 0.16's DistributedOptimizer knows
MCORE_SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "fully_sharded_model_space",
                        "dp_zero_gather_scatter", "fully_sharded_bucket_space", "fsdp_dtensor")
_BUCKET_STATE = re.compile(r"^(?:chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+\."
                           r"gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+\.([^.]+)$")


def _refuse_unknown_forms(meta: CheckpointMeta, found: dict[str, Any]) -> None:
    """UnsupportedError (one line) for optimizer state that Megatron-Core would not load or
    that is not rebuilt: a declared sharding type it does not know, per-bucket states other
    than Adam's (param, exp_avg, exp_avg_sq)."""
    declared = found.get("declared")
    if found.get("type") and declared and declared not in MCORE_SHARDING_TYPES:
        raise UnsupportedError(f"{meta.root}: the content metadata's distrib_optim_sharding_type "
                               f"{declared!r} is not a form Megatron-Core knows (one of "
                               f"{', '.join(MCORE_SHARDING_TYPES)})",
                               hint="reshard with --drop-optimizer")
    if found.get("type") != "dp_reshardable":
        return
    for k in meta.tensors:
        m = _BUCKET_STATE.match(k)
        if m and m.group(1) not in STATES:
            raise UnsupportedError(f"{meta.root}: optimizer state {m.group(1)!r} in the "
                                   f"per-bucket tensors ({k}) is not rebuilt: only Adam's "
                                   f"{', '.join(STATES)} are", hint="reshard with "
                                   "--drop-optimizer (nothing is guessed)")


class UnflattenedOptimizerView(Reader):
    """See the module docstring."""

    def __init__(self, reader: Reader, rules: RuleSet | None = None):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self.format_name = reader.format_name
        meta = reader.metadata()
        self._common = reader.common()
        args = args_of(meta, self._common)
        sizes = model_sizes_from(meta, self._common)
        source = source_layout_from(meta, self._common)
        where = f"{meta.root}: {self.form} optimizer state"
        per_bucket, self._groups = self._group_objects(meta)
        try:
            self.buckets = optimizer_bucket_layout(meta, sizes, source, args, rules,
                                                   dtype=self._dtype())
        except BucketLayoutError as exc:
            raise UnsupportedError(f"{where}: {exc}", hint="reshard with --drop-optimizer, or "
                                   "re-save with --dist-ckpt-optim-fully-reshardable") from None
        dp = int(args.get("data_parallel_size") or 1)
        problems = self._prove(meta, per_bucket, dp)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UnsupportedError(f"{where}: the rebuilt bucket layout does not match the "
                                   f"checkpoint: {problems[0]}{more}",
                                   hint="reshard with --drop-optimizer (nothing is guessed)")
        domains = len({b.domain for b in self.buckets})
        self.summary = (f"unflattened from {self.form}: {plural(len(self.buckets), 'bucket')} in "
                        f"{plural(domains, 'model-parallel domain')} "
                        f"proven against {self.proven_by}")
        self._sources: dict[str, list[tuple[Piece, BucketParam, Bucket]]] = {}
        self._meta = self._build_meta(meta)

    form = "dp_reshardable"
    proven_by = "per_bucket_numel and every stored piece"

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    def _dtype(self) -> str | None:
        return None

    def _prove(self, meta: CheckpointMeta, per_bucket: dict[Domain, tuple[Any, Any]],
               dp: int) -> list[str]:
        return prove_bucket_layout(self.buckets, meta, per_bucket, dp)

    def _flat(self, b: Bucket, p: BucketParam, state: str) -> Any:
        """The ``numel`` elements of parameter ``p`` in bucket ``b``'s ``state``."""
        return self.inner.read(b.key(state), (slice(p.start, p.start + p.numel),))

    def _group_objects(self, meta: CheckpointMeta) -> tuple[dict[Domain, tuple[Any, Any]],
                                                             dict[Domain, Any]]:
        values: dict[tuple[Domain, str], Any] = {}
        for o in meta.objects:
            m = _GROUP.match(o.key)
            if m:
                values[((m.group(1) or "", int(m.group(2))), m.group(3))] = \
                    self.inner.read_object(o.unique_key)
        groups = {i for i, _ in values}
        per_bucket = {i: (values[(i, "per_bucket_numel")], values[(i, "per_bucket_numel_unpadded")])
                      for i in groups if (i, "per_bucket_numel") in values
                      and (i, "per_bucket_numel_unpadded") in values}
        self._param_state = {i: values[(i, "param_state")] for i in groups
                             if (i, "param_state") in values}
        return per_bucket, {i: values.get((i, "optimizer")) for i in groups}

    def _build_meta(self, meta: CheckpointMeta) -> CheckpointMeta:
        tensors = {k: t for k, t in meta.tensors.items()
                   if not split_chained(k)[1].startswith("optimizer.distributed.")}
        by_key: dict[str, list[tuple[Piece, BucketParam, Bucket]]] = {}
        for b in self.buckets:
            for p in b.params:
                for piece in p.local.pieces:
                    if piece.fill is None:
                        by_key.setdefault(p.key, []).append((piece, p, b))
        dtype = self._state_dtype(meta)
        for key, found in by_key.items():
            seen: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}
            for piece, p, b in found:  # replicated over tp: the lowest tp rank's copy
                seen.setdefault((piece.global_offsets, piece.sizes), (piece, p, b))
            chunks = tuple(ChunkRef(offsets=o, sizes=s) for o, s in seen)
            for state in STATES:
                vk = f"optimizer.state.{state}.{key}"
                tensors[vk] = TensorMeta(key=vk, dtype=dtype, shape=meta.tensors[key].shape,
                                         chunks=chunks, origin="dp_reshardable buckets")
                self._sources[vk] = list(seen.values())
        objects = tuple(o for o in meta.objects if not _GROUP.match(o.key))
        extras = dict(meta.extras)
        extras["optimizer_sharding"] = {"type": "fully_reshardable", "source": self.summary,
                                        "declared": self.form}
        common = dict(meta.common)
        if isinstance(common.get("content_metadata"), dict):
            common["content_metadata"] = self._content_metadata(common["content_metadata"])
        return replace(meta, tensors=tensors, objects=objects, extras=extras, common=common)

    def _state_dtype(self, meta: CheckpointMeta) -> str:
        return next(t.dtype for k, t in meta.tensors.items()
                    if split_chained(k)[1].startswith("optimizer.distributed."))

    @property
    def chained(self) -> list[str]:
        """The ChainedOptimizer's prefixes (``chained_0.``, ...); empty for one optimizer."""
        return sorted({b.prefix for b in self.buckets if b.prefix})

    def _content_metadata(self, cm: dict[str, Any]) -> dict[str, Any]:
        # fully_reshardable keys carry no chained prefix only with chained_optim_avoid_prefix
        extra = {"chained_optim_avoid_prefix": True} if self.chained else {}
        return {**cm, "distrib_optim_sharding_type": "fully_reshardable", **extra}

    def metadata(self) -> CheckpointMeta:
        return self._meta

    def common(self) -> dict[str, Any]:
        common = dict(self._common)
        cm = common.get("content_metadata")
        if isinstance(cm, dict):
            common["content_metadata"] = self._content_metadata(cm)
        stored = common.get("optimizer") or {}
        if not self.chained:
            common["optimizer"] = self._one_optimizer(stored, "")
            return common
        common["optimizer"] = {i: self._one_optimizer(stored.get(i) or {}, prefix)
                               for i, prefix in enumerate(self.chained)}
        return common

    def _one_optimizer(self, stored: Any, prefix: str) -> dict[str, Any]:
        """One optimizer's common entry: its param groups (from its lowest domain's object)."""
        optimizer = dict(stored or {})
        domains = sorted(d for d in self._groups if d[0] == prefix)
        groups = self._groups.get(domains[0]) if domains else None
        if groups is not None:
            optimizer["optimizer"] = copy.deepcopy(groups)
        optimizer["param_state_sharding_type"] = "fully_reshardable"
        return optimizer

    def common_for_target(self, common: dict[str, Any], target: Any) -> dict[str, Any]:
        """``common`` (from :meth:`common`) with its ``optimizer`` entry shaped as the target
        layout's optimizer: a ChainedOptimizer saves one entry per optimizer, and at ``ep`` 1
        the routed experts join the dense optimizer (its param groups; the expert optimizer and
        its entry go)."""
        expert_parallel = int(getattr(target, "ep", 1) or 1) > 1
        if not self.chained and expert_parallel and any(
                p.key in moe_expert_keys() for b in self.buckets for p in b.params):
            raise UnsupportedError("the source has one optimizer (its experts in the dense "
                                   "buffers): the expert optimizer's param groups at ep > 1 "
                                   "are not in it", hint="reshard with --drop-optimizer")
        if not self.chained or expert_parallel:
            return common
        return {**common, "optimizer": common["optimizer"][0]}

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        if key not in self._sources:
            return self.inner.read(key, slices)
        import torch

        from ckpt_tool.formats.torch_zip import torch_dtype

        t = self._meta.tensors[key]
        state = key.split(".")[2]
        region = [range(*(slices[d] if slices and d < len(slices) else slice(None))
                        .indices(n)) for d, n in enumerate(t.shape)]
        if any(r.step != 1 for r in region):
            raise UnsupportedError(f"{key}: strided reads are not supported")
        lo = [r.start for r in region]
        hi = [r.stop for r in region]
        out = torch.empty([h - l for l, h in zip(lo, hi)], dtype=torch_dtype(t.dtype))
        covered = 0
        cache: tuple[Any, Any] | None = None
        for piece, p, b in self._sources[key]:
            a = [max(l, o) for l, o in zip(lo, piece.global_offsets)]
            z = [min(h, o + s) for h, o, s in zip(hi, piece.global_offsets, piece.sizes)]
            if any(x >= y for x, y in zip(a, z)):
                continue
            if cache is None or cache[0] is not p:
                flat = self._flat(b, p, state)
                cache = (p, flat.reshape(p.local.local_shape))
            local = cache[1]
            src = tuple(slice(x - o + lo_, y - o + lo_) for x, y, o, lo_ in
                        zip(a, z, piece.global_offsets, piece.local_offsets))
            dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, z, lo))
            out[dst] = local[src]
            covered += math.prod(y - x for x, y in zip(a, z))
        if covered != out.numel():
            raise UnsupportedError(f"{key}: the bucket pieces cover {covered} of "
                                   f"{out.numel()} requested elements")
        return out

    def read_object(self, unique_key: str) -> Any:
        return self.inner.read_object(unique_key)

    def close(self) -> None:
        self.inner.close()


class GatheredOptimizerView(UnflattenedOptimizerView):
    """The ``dp_zero_gather_scatter`` form: per model-parallel domain one ``param_state`` object
    with each buffer's state gathered over DP, every bucket's unpadded range back to back. The
    rebuilt layout must give the stored buffer length, and every fp32 main parameter must round
    exactly to the stored model parameter. The objects are read whole (one domain's state in
    memory at a time)."""

    form = "dp_zero_gather_scatter"
    proven_by = "each buffer's length and every main parameter against its model parameter"

    def _buffer(self, group: Domain) -> tuple[str, dict[str, Any]]:
        state = self._param_state.get(group)
        if not isinstance(state, dict) or not isinstance(state.get(0), dict) or len(state) != 2:
            raise UnsupportedError(f"{group[0]}dp_group_idx_{group[1]}: param_state is missing "
                                   "or holds more than one buffer (not rebuilt)")
        (dtype, states), = state[0].items()
        return str(dtype), states

    def _dtype(self) -> str | None:
        return self._buffer(min(self._param_state or {("", 0): None}))[0]

    def _state_dtype(self, meta: CheckpointMeta) -> str:
        return "float32"

    def _flat(self, b: Bucket, p: BucketParam, state: str) -> Any:
        start = sum(o.numel_unpadded for o in self.buckets if o.domain == b.domain
                    and o.bucket_idx < b.bucket_idx) + p.start
        return self._buffer(b.domain)[1][state][start:start + p.numel]

    def _prove(self, meta: CheckpointMeta, per_bucket: dict[int, tuple[Any, Any]],
               dp: int) -> list[str]:
        import torch

        problems = []
        for group in sorted({b.domain for b in self.buckets}):
            where = f"{group[0]}dp_group_idx_{group[1]}"
            if group not in self._param_state:
                return [f"{where}: param_state is missing"]
            states = self._buffer(group)[1]
            want = sum(b.numel_unpadded for b in self.buckets if b.domain == group)
            got = [int(states.get("numel_unpadded", -1))] + [
                int(states[s].numel()) for s in STATES if s in states]
            if any(n != want for n in got) or len(got) != 1 + len(STATES):
                problems.append(f"{where}: rebuilt buffer of {want} elements, stored {got}")
        if problems:
            return problems
        seen = set()  # a tp-replicated parameter: the lowest tp rank's copy, the one used
        for b in self.buckets:
            for p in b.params:
                main = self._flat(b, p, "param").reshape(p.local.local_shape)
                for piece in p.local.pieces:
                    if piece.fill is not None or (p.key, piece.global_offsets) in seen:
                        continue
                    seen.add((p.key, piece.global_offsets))
                    model = self.inner.read(p.key, tuple(
                        slice(o, o + n) for o, n in zip(piece.global_offsets, piece.sizes)))
                    part = main[tuple(slice(o, o + n) for o, n in
                                      zip(piece.local_offsets, piece.sizes))]
                    if not torch.equal(part.to(model.dtype), model):
                        return [f"{b.prefix}dp_group_idx_{b.dp_group_idx} bucket "
                                f"{b.bucket_idx}: the main parameter at element {p.start} "
                                f"does not round to {p.key}"]
        return []
