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
from dataclasses import dataclass, replace
from typing import Any

from ckpt_tool.errors import UnsupportedError, plural
from ckpt_tool.formats.base import Reader
from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta, split_chained
from ckpt_tool.ops._optim_model_space import _MAIN_0_15, ModelSpaceDistOptimizerView
from ckpt_tool.planning.source_model import model_sizes_from
from ckpt_tool.planning.source_layout import (configured_args, optimizer_domains,
                                              source_layout_from)
from ckpt_tool.planning.layout import RuleSet
from ckpt_tool.planning.bucket_choices import (LayoutChoice, dp_candidates, layout_choices,
                                              spec_from_args, stored_bucket_sizes)
from ckpt_tool.planning.bucket_proof import prove_bucket_layout
from ckpt_tool.planning.optim_buckets import (STATES, Bucket, BucketLayoutError, BucketParam,
                                              BucketSizeUnknown, UnknownParameterOrder,
                                              bucket_size_configured, configured_dp,
                                              optimizer_bucket_layout)
from ckpt_tool.ops._optim_derived_order import derive_bucket_layout, describe_leftover
from ckpt_tool.planning.param_order import model_key_prefix, moe_expert_keys
from ckpt_tool.planning.pieces import Piece

__all__ = ["UnflattenedOptimizerView", "GatheredOptimizerView", "BucketLayoutHints",
           "unflatten_bucketed_optimizer"]

_GROUP = re.compile(r"^(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
                    r"(per_bucket_numel|per_bucket_numel_unpadded|optimizer|param_state)$")
Domain = tuple[str, int]  # (chained prefix, dp_group_idx)


def unflatten_bucketed_optimizer(reader: Reader, rules: RuleSet | None = None,
                                 hints: BucketLayoutHints | None = None) -> Reader:
    """``reader`` itself unless it holds ``dp_reshardable`` optimizer state; then the proven
    model-space view (UnsupportedError, exit 2, naming what does not match, when the layout
    cannot be rebuilt or proven). ``hints``: what the user's flags say about the buffers."""
    meta = reader.metadata()
    found = meta.extras.get("optimizer_sharding") or {}
    _refuse_unknown_forms(meta, found)
    if found.get("type") == "dp_reshardable":
        return UnflattenedOptimizerView(reader, rules, hints)
    if found.get("type") == "dp_zero_gather_scatter":
        return GatheredOptimizerView(reader, rules, hints)
    if found.get("type") == "fully_sharded_model_space":
        return ModelSpaceDistOptimizerView(
            reader, "converted from fully_sharded_model_space (flattened, read in model space)")
    if meta.kind.legacy_rank_files and any(o.key == "distrib_optim" for o in meta.objects) and any(
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


@dataclass(frozen=True)
class BucketLayoutHints:
    """What the user says about the source's DDP buffers where the checkpoint's configuration
    is silent or wrong (``--ddp-bucket-size``, ``--local-spec``/``--te-spec``): the bucket
    size in elements (0: one bucket per buffer; None: from the checkpoint) and the layer
    spec (``local`` / ``transformer_engine``; None: from the checkpoint)."""

    bucket_size: int | None = None
    spec: str | None = None

    def args(self, args: dict[str, Any]) -> dict[str, Any]:
        """``args`` with the bucket size given."""
        if self.bucket_size is None:
            return args
        return {**args, "overlap_grad_reduce": self.bucket_size > 0,
                "ddp_bucket_size": self.bucket_size or None}


class UnflattenedOptimizerView(Reader):
    """See the module docstring."""

    def __init__(self, reader: Reader, rules: RuleSet | None = None,
                 hints: BucketLayoutHints | None = None):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self.format_name = reader.format_name
        meta = reader.metadata()
        self._common = reader.common()
        hints = hints or BucketLayoutHints()
        args = hints.args(configured_args(meta, self._common)[0])
        sizes = model_sizes_from(meta, self._common)
        source = source_layout_from(meta, self._common)
        per_bucket, self._groups = self._group_objects(meta)
        self.buckets, self.choice, how = self._proven_layout(
            meta, sizes, source, args, rules, hints, per_bucket)
        domains = len({b.domain for b in self.buckets})
        self.summary = (f"unflattened from {self.form}: {plural(len(self.buckets), 'bucket')} in "
                        f"{plural(domains, 'model-parallel domain')} "
                        f"proven against {self.proven_by} ({how})")
        self._sources: dict[str, list[tuple[Piece, BucketParam, Bucket]]] = {}
        self._meta = self._build_meta(meta)

    form = "dp_reshardable"
    proven_by = "per_bucket_numel and every stored piece"

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    def _proven_layout(self, meta: CheckpointMeta, sizes: Any, source: Any,
                       args: dict[str, Any], rules: RuleSet | None, hints: BucketLayoutHints,
                       per_bucket: dict[Domain, tuple[Any, Any]]
                       ) -> tuple[list[Bucket], LayoutChoice, str]:
        """The layout the configuration and the flags give, what they leave open tried
        (docs/optimizer.md): the one proven choice, or UnsupportedError naming what does not
        match or what the stored data cannot decide and the flag that decides it."""
        where = f"{meta.root}: {self.form} optimizer state"
        configured = configured_dp(source, args)
        dps = [configured] if configured else (self._dp_candidates(meta, per_bucket) or [1])
        stored = stored_bucket_sizes(per_bucket) if per_bucket else None
        proven: list[tuple[LayoutChoice, list[Bucket]]] = []
        failed: list[tuple[LayoutChoice, list[str]]] = []
        padded = [n for buffers in stored_bucket_sizes(per_bucket, 0).values()
                  for sizes_ in buffers for n in sizes_]
        for choice in layout_choices(args, dps, hints.spec, padded):
            try:
                buckets = optimizer_bucket_layout(meta, sizes, source, choice.args(args),
                                                  rules, spec=choice.spec,
                                                  dtype=self._dtype(), dp=choice.dp,
                                                  stored=stored)
            except BucketSizeUnknown as exc:
                raise UnsupportedError(f"{where}: {exc}", hint="pass the training run's "
                                       "--ddp-bucket-size N (0: overlap_grad_reduce was "
                                       "off), or reshard with --drop-optimizer") from None
            except UnknownParameterOrder as exc:
                if not self.derivable:
                    raise UnsupportedError(f"{where}: {exc}", hint="reshard with "
                                           "--drop-optimizer, or re-save with "
                                           "--dist-ckpt-optim-fully-reshardable") from None
                return self._derived_layout(meta, sizes, source, args, rules, per_bucket,
                                            dps, where, None)
            except BucketLayoutError as exc:
                raise UnsupportedError(f"{where}: {exc}", hint="reshard with --drop-optimizer, "
                                       "or re-save with --dist-ckpt-optim-fully-reshardable"
                                       ) from None
            self.buckets = buckets
            problems = self._prove(meta, per_bucket, choice.dp)
            if problems:
                failed.append((choice, problems))
            else:
                proven.append((choice, buckets))
        if not proven and self.derivable and per_bucket and hints == BucketLayoutHints():
            # no known layer spec's order fits, and no flag says otherwise: the order the
            # stored data gives (a flag that contradicts the stored data fails its proof)
            return self._derived_layout(meta, sizes, source, args, rules, per_bucket, dps,
                                        where, failed)
        if not proven:
            choice, problems = min(failed, key=lambda f: len(f[1]))
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            tried = {c.spec_name for c, _p in failed}
            with_ = (f" with the {choice.spec_name} parameter order" if len(tried) > 1 else "")
            raise UnsupportedError(f"{where}: the rebuilt bucket layout does not match the "
                                   f"checkpoint{with_}: {problems[0]}{more}",
                                   hint="reshard with --drop-optimizer (nothing is guessed)")
        specs = sorted({c.spec_name for c, _b in proven})
        if len(specs) > 1:
            raise UnsupportedError(
                f"{where}: the stored pieces fit both the {' and the '.join(specs)} parameter "
                "orders, and the checkpoint's configuration does not name the layer spec "
                "(args.transformer_impl)", hint="pass --local-spec or --te-spec, as the model "
                "was trained")
        choice, buckets = proven[0]
        return buckets, choice, self._how(args, hints, configured, proven, bool(stored))

    #: whether the parameter order may be read off the stored data (per-bucket pieces)
    derivable = True

    def _derived_layout(self, meta: CheckpointMeta, sizes: Any, source: Any,
                        args: dict[str, Any], rules: RuleSet | None,
                        per_bucket: dict[Domain, tuple[Any, Any]], dps: list[int], where: str,
                        failed: list[tuple[LayoutChoice, list[str]]] | None
                        ) -> tuple[list[Bucket], LayoutChoice, str]:
        """The layout whose parameter order is read off the stored data
        (:mod:`ckpt_tool.ops._optim_derived_order`), proven like any other."""
        known = ("no known layer spec's parameter order fits the stored pieces, and "
                 if failed else "")
        try:
            buckets, leftover = derive_bucket_layout(self.inner, meta, sizes, source, args,
                                                     rules, per_bucket, dps[0])
        except BucketLayoutError as exc:
            raise UnsupportedError(f"{where}: {known}the parameter order read off the stored "
                                   f"data fails: {exc}", hint="reshard with --drop-optimizer "
                                   "(nothing is guessed)") from None
        self.buckets = buckets
        problems: list[str] = []
        for dp in dps:
            problems = self._prove(meta, per_bucket, dp)
            if not problems:
                how = ("bucket boundaries from per_bucket_numel_unpadded; parameter order read "
                       "off the stored data (each main parameter against the weights); "
                       f"dp {dp}")
                rest = describe_leftover(leftover)
                return buckets, LayoutChoice("stored data", dp, False), how + (
                    f"; {rest}" if rest else "")
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UnsupportedError(f"{where}: the bucket layout read off the stored data does not "
                               f"match the checkpoint: {problems[0]}{more}",
                               hint="reshard with --drop-optimizer (nothing is guessed)")

    def _how(self, args: dict[str, Any], hints: BucketLayoutHints, configured: int | None,
             proven: list[tuple[LayoutChoice, list[Bucket]]], stored: bool) -> str:
        """Where the layout came from, in a few words."""
        choice = proven[0][0]
        parts = [("bucket boundaries from --ddp-bucket-size" if hints.bucket_size is not None
                  else "bucket boundaries from the configuration"
                  if bucket_size_configured(args) else
                  "bucket boundaries from per_bucket_numel_unpadded" if stored else
                  "bucket boundaries not needed: no parameter start is padded")]
        parts.append(f"{choice.spec_name} parameter order"
                     + (" (--local-spec/--te-spec)" if hints.spec else
                        "" if spec_from_args(args) else " (the only one that fits)"))
        dps = sorted({c.dp for c, _b in proven})
        parts.append(f"dp {choice.dp}" if configured else
                     f"dp {dps[0]} (from the stored pieces)" if len(dps) == 1 else
                     f"dp not decided by the stored pieces ({', '.join(map(str, dps))}), "
                     "the same placement for each")
        return "; ".join(parts)

    def _dp_candidates(self, meta: CheckpointMeta,
                       per_bucket: dict[Domain, tuple[Any, Any]]) -> list[int]:
        return dp_candidates(meta, per_bucket)

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
        extras["optimizer_domains"] = optimizer_domains(meta)
        common = dict(meta.common)
        common["content_metadata"] = self._content_metadata(common.get("content_metadata"))
        return replace(meta, tensors=tensors, objects=objects, extras=extras, common=common)

    def _state_dtype(self, meta: CheckpointMeta) -> str:
        return next(t.dtype for k, t in meta.tensors.items()
                    if split_chained(k)[1].startswith("optimizer.distributed."))

    @property
    def chained(self) -> list[str]:
        """The ChainedOptimizer's prefixes (``chained_0.``, ...); empty for one optimizer."""
        return sorted({b.prefix for b in self.buckets if b.prefix})

    def _content_metadata(self, cm: Any) -> dict[str, Any]:
        """The content metadata with the form the state now has (a source saved without
        content metadata gets it: a resume must build the fully_reshardable form)."""
        # fully_reshardable keys carry no chained prefix only with chained_optim_avoid_prefix
        extra = {"chained_optim_avoid_prefix": True} if self.chained else {}
        return {**(cm if isinstance(cm, dict) else {}),
                "distrib_optim_sharding_type": "fully_reshardable", **extra}

    def metadata(self) -> CheckpointMeta:
        return self._meta

    def objects_in_common(self) -> frozenset[str]:
        return self.inner.objects_in_common()

    def common(self) -> dict[str, Any]:
        common = dict(self._common)
        common["content_metadata"] = self._content_metadata(common.get("content_metadata"))
        stored = common.get("optimizer") or {}
        # NeMo 2 saves its one Lightning optimizer's state dict in a list
        listed = isinstance(stored, list) and len(stored) == 1
        stored = stored[0] if listed else stored
        if not self.chained:
            entry: Any = self._one_optimizer(stored, "")
        else:
            entry = {i: self._one_optimizer(stored.get(i) or {}, prefix)
                     for i, prefix in enumerate(self.chained)}
        common["optimizer"] = [entry] if listed else entry
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
        keys = [p.key for b in self.buckets for p in b.params]
        if not self.chained and expert_parallel and any(
                k in moe_expert_keys(model_key_prefix(keys)) for k in keys):
            raise UnsupportedError("the source has one optimizer (its experts in the dense "
                                   "buffers): the expert optimizer's param groups at ep > 1 "
                                   "are not in it", hint="reshard with --drop-optimizer")
        if not self.chained or expert_parallel:
            return common
        stored = common["optimizer"]
        if isinstance(stored, list):  # NeMo 2's list of one
            return {**common, "optimizer": [stored[0][0]]}
        return {**common, "optimizer": stored[0]}

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        if key not in self._sources:
            return self.inner.read(key, slices)
        import torch

        from ckpt_tool.formats.containers.torch_zip.torch_zip_read import torch_dtype

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
    derivable = False  # no per-bucket pieces to walk
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
