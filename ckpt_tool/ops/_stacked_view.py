"""A Megatron-LM legacy checkpoint seen with Megatron-Core's dist keys, for dist targets.

Legacy files hold the modules' own state-dict names, one key per layer
(``decoder.layers.<n>.<rest>``, global layer numbers in the legacy reader); Megatron-Core dist
checkpoints store the layers stacked (``decoder.layers.<rest>`` with the layer axis first),
what Megatron-LM's ``--ckpt-convert-format torch_dist`` writes after loading the legacy files
into the model. :class:`StackedView` presents a legacy reader that way, so ``convert`` and
``reshard`` write checkpoints a Megatron-Core model loads with its complete sharded state dict:

* per-layer keys stacked (routed experts, ``…local_experts.<e>.…``, get a second,
  global-expert axis under the name SequentialMLP saves: ``…mlp.experts.experts.…``);
* a local-spec model's norms named as its ``sharded_state_dict_keys_map`` saves them
  (``input_layernorm.*`` -> ``self_attention.linear_qkv.layer_norm_*``, ``pre_mlp_layernorm.*``
  -> ``mlp.linear_fc1.layer_norm_*``, docs/formats.md §5); a Transformer-Engine model's names
  are already the dist names;
* the ``_extra_state`` ShardedObjects the model saves (:mod:`ckpt_tool.ops._extra_state`);
* each rank file's ``rng_state`` as the ``rng_state/shard_{pp}.{tp}_{PP}.{TP}`` ShardedObject
  Megatron-LM saves (without expert parallelism), so a resume at the same layout finds it.

The layer spec comes from the legacy keys (a separate ``input_layernorm`` is the local spec),
else ``args.transformer_impl``.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any

from ckpt_tool.errors import plural
from ckpt_tool.formats.base import Reader
from ckpt_tool.formats.legacy.layout import LOCAL_TO_DIST_NAMES, parse_rank_dir
from ckpt_tool.model import (CheckpointMeta, FormatKind, ObjectMeta, TensorMeta,
                             is_optimizer_key)
from ckpt_tool.ops._extra_state import ExtraStates
from ckpt_tool.planning.extra_state import LOCAL, legacy_layer_spec

__all__ = ["StackedView", "stacked_view"]

#: Formats Megatron-Core loads as dist checkpoints: a legacy source is stacked for them.

_PER_LAYER = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.)local_experts\.(\d+)\.(.*)$")


class StackedView(Reader):
    """A legacy reader's checkpoint with Megatron-Core's dist keys (see the module doc)."""

    format_name = "legacy"

    def __init__(self, reader: Reader):
        super().__init__(reader.path, trust=reader.trust)
        self.verify = reader.verify
        self.inner = reader
        self._meta: CheckpointMeta | None = None
        self._parts: dict[str, dict[tuple[int, ...], str]] = {}
        self._extra: ExtraStates | None = None
        self._rng: dict[str, str] = {}  # rng_state/shard_… -> the rank file's rng_state/<dir>
        self.dropped: list[str] = []
        self.spec = LOCAL
        self.stacked = 0  # per-layer keys folded into stacked ones

    def stored_archives(self, chunks: Any) -> list[Any]:
        return self.inner.stored_archives(chunks)

    def metadata(self) -> CheckpointMeta:
        if self._meta is not None:
            return self._meta
        meta = self.inner.metadata()
        self.spec = legacy_layer_spec(meta.tensors, meta.extras.get("args"))
        groups: dict[str, dict[tuple[int, ...], TensorMeta]] = {}
        tensors: dict[str, TensorMeta] = {}
        for key, t in meta.tensors.items():
            m = _PER_LAYER.match(key)
            if m is None:
                tensors[key] = t
                continue
            rest = self._dist_name(m.group(3))
            index: tuple[int, ...] = (int(m.group(2)),)
            e = _LOCAL_EXPERT.match(rest)
            if e is not None:
                rest, index = f"{e.group(1)}experts.{e.group(3)}", index + (int(e.group(2)),)
            groups.setdefault(m.group(1) + rest, {})[index] = t
        for key, parts in groups.items():
            first = next(iter(parts.values()))
            grid = tuple(max(i[d] for i in parts) + 1 for d in range(len(next(iter(parts)))))
            if len(parts) != math.prod(grid) or any(
                    (t.shape, t.dtype) != (first.shape, first.dtype) for t in parts.values()):
                for t in parts.values():  # not a regular stack: keep the per-layer keys
                    tensors[t.key] = t
                continue
            lead = (1,) * len(grid)
            chunks = tuple(replace(c, offsets=(*i, *c.offsets), sizes=(*lead, *c.sizes))
                           for i in sorted(parts) for c in parts[i].chunks)
            tensors[key] = TensorMeta(key=key, dtype=first.dtype, shape=(*grid, *first.shape),
                                      chunks=chunks)
            self._parts[key] = {i: t.key for i, t in parts.items()}
            self.stacked += len(parts)
        self._extra = ExtraStates(tensors, self.spec)
        objects = self._rng_objects(meta) + self._extra.objects
        self._meta = replace(meta, tensors=tensors, objects=objects)
        return self._meta

    def _rng_objects(self, meta: CheckpointMeta) -> tuple[ObjectMeta, ...]:
        """The source's objects, each rank file's ``rng_state`` as the ShardedObject
        Megatron-LM saves it under (``rng_state/shard_{pp}.{tp}_{PP}.{TP}``, the same list
        of per-data-parallel-rank states) and without the rank files' copies of
        ``opt_param_scheduler``, when there is no expert parallelism (which keys the states by
        data-parallel rank as well) and every rank file has an ``rng_state``."""
        tp, pp, ep = (int(meta.extras.get(k) or 1) for k in ("tp", "pp", "ep"))
        rng = {o.unique_key: o for o in meta.objects if o.key == "rng_state"}
        places = {}
        for o in rng.values():
            where = parse_rank_dir(o.unique_key.split("/", 1)[1], pp)
            if where is not None:
                places[o.unique_key] = where
        if ep != 1 or len(places) != tp * pp or len(places) != len(rng):
            return meta.objects
        out = []
        for o in meta.objects:
            if o.key == "opt_param_scheduler" and "/" in o.unique_key:
                self.dropped.append(o.unique_key)  # each rank file's copy of the common one
                continue
            if o.unique_key in places:
                t, p, _e = places[o.unique_key]
                o = ObjectMeta(key="rng_state", unique_key=f"rng_state/shard_{p}.{t}_{pp}.{tp}",
                               file=o.file, global_shape=(pp, tp), global_offset=(p, t))
                self._rng[o.unique_key] = next(k for k, w in places.items() if w == (t, p, 0))
            out.append(o)
        return tuple(out)

    def _dist_name(self, rest: str) -> str:
        if self.spec == LOCAL:
            for old, new in LOCAL_TO_DIST_NAMES:
                if rest.startswith(old):
                    return new + rest[len(old):]
        return rest

    def notes(self) -> list[str]:
        """What the view changed, for the command's messages."""
        self.metadata()
        model = [k for k in self._parts if not is_optimizer_key(k)]
        n_model = sum(len(self._parts[k]) for k in model)
        out = []
        if self.stacked:
            out.append(f"renamed {plural(n_model, 'per-layer key')} to Megatron-Core's stacked "
                       f"names ({plural(len(model), 'key')}, layer axis first"
                       + (", local-spec norms as linear_qkv/linear_fc1.layer_norm_*"
                          if self.spec == LOCAL else "")
                       + (f"; optimizer state alike: {self.stacked - n_model} keys"
                          if self.stacked > n_model else "") + ")")
        if self.dropped:
            out.append(f"left out the rank files' {len(self.dropped)} copies of "
                       "opt_param_scheduler (the common state holds it)")
        if self._rng:
            out.append(f"stored each rank file's rng_state as Megatron-Core's "
                       f"rng_state/shard_<pp>.<tp>_<PP>.<TP> objects ({len(self._rng)})")
        if self._extra is not None and self._extra.objects:
            n = len(self._extra.objects)
            out.append(f"added {plural(n, '_extra_state object')} as Megatron-Core saves them "
                       f"for the {'local' if self.spec == LOCAL else 'Transformer-Engine'} "
                       f"layer spec")
        return out

    def read(self, key: str, slices: tuple[slice, ...] | None = None) -> Any:
        import itertools

        import torch

        meta = self.metadata()
        if key not in self._parts:
            return self.inner.read(key, slices)
        parts = self._parts[key]
        n_lead = len(next(iter(parts)))
        shape = meta.tensors[key].shape
        slices = tuple(slices or ())
        lead = [range(*(slices[d] if d < len(slices) else slice(None)).indices(shape[d]))
                for d in range(n_lead)]
        rest = slices[n_lead:] or None
        pieces = [self.inner.read(parts[i], rest) for i in itertools.product(*lead)]
        out = torch.stack(pieces) if pieces else torch.empty(0)
        return out.reshape(*(len(r) for r in lead), *out.shape[1:])

    def read_object(self, unique_key: str) -> Any:
        self.metadata()
        if self._extra is not None and unique_key in self._extra:
            return self._extra.payload(unique_key)
        return self.inner.read_object(self._rng.get(unique_key, unique_key))

    def common(self) -> dict[str, Any]:
        """The source's common state; without its per-rank-file ``rng_state`` when those
        are objects now."""
        self.metadata()
        common = self.inner.common()
        if self._rng:
            common = {k: v for k, v in common.items() if k != "rng_state"}
        return common

    def objects_in_common(self) -> frozenset[str]:
        return self.inner.objects_in_common()

    def close(self) -> None:
        self.inner.close()


def stacked_view(reader: Reader, target_format: str) -> StackedView | None:
    """The stacked view of a legacy ``reader`` for a dist ``target_format``; None when the
    source is not legacy or the target is not a dist format."""
    if reader.metadata().kind.legacy_rank_files and FormatKind(target_format).megatron_dist:
        return StackedView(reader)
    return None
