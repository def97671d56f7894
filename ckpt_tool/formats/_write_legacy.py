"""Writer of Megatron-LM legacy checkpoints (``--ckpt-format torch``) at the source's layout.

Layout written (what Megatron-LM's ``save_checkpoint`` writes, FORMATS.md section 4)::

    latest_checkpointed_iteration.txt            # the iteration, or "release"
    iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt
        {"args", "checkpoint_version", "iteration", "model", ...common state}

Each rank's ``model`` holds its pipeline stage's layers with stage-local numbers and its TP
shard of each parameter (``_legacy_layout.split_rule``: vocab/column along dim 0, row along
dim 1, SwiGLU ``[W_r; V_r]``, the rest replicated). Keys may come with global layer numbers
(``decoder.layers.7.…``) or stacked over layers as Megatron-Core dist checkpoints store them
(``decoder.layers.…`` with the layer axis first): both are written per layer.

Changing TP/PP is ``ckpt reshard``'s job: ``--tp/--pp`` here must match the source's layout
(or give one for a source without a recorded layout). Memory: one rank's share of the model.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ckpt_tool.errors import UsageError
from ckpt_tool.formats._legacy_layout import (GLU, LAYER_RE, REPLICATED, rank_dir_name,
                                              split_rule, stage_layer_offsets)
from ckpt_tool.formats.writer import WriteRequest, Writer

__all__ = ["LegacyWriter"]

_STACKED_RE = re.compile(r"^((?:.*\.)?(?:decoder|encoder)\.layers\.)([^0-9].*)$")
_FIRST_STAGE = ("embedding.",)
_COMMON_KEYS = ("checkpoint_version", "iteration", "num_floating_point_operations_so_far",
                "opt_param_scheduler")


@dataclass(frozen=True)
class _Entry:
    """One local (per-layer) parameter: its TP1/PP1 key, global layer, and the rectangle of the
    target tensor it is (``offsets``/``sizes``; a stacked key's layer row is squeezed)."""

    key: str
    target_key: str
    layer: int | None
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    squeeze: bool


class LegacyWriter(Writer):
    """See the module docstring."""

    format_name = "legacy"

    def write(self, request: WriteRequest) -> list[str]:
        import torch

        notes: list[str] = []
        summary = self.options.extra.get("source_common_summary") or {}
        tp, pp = self._layout(summary)
        num_layers = self._num_layers(request, summary)
        from ckpt_tool.ops._reshard_io import as_namespace

        swiglu = bool((summary.get("model") or {}).get("swiglu", False)
                      or getattr(as_namespace(request.common.get("args")), "swiglu", False))
        entries = self._entries(request, num_layers)
        offsets = stage_layer_offsets(num_layers, pp) if num_layers else [0]
        per_rank = _per_rank_objects(request)
        iteration = request.common.get("iteration")
        iter_dir = "release" if iteration is None else f"iter_{int(iteration):07d}"
        (self.directory / iter_dir).mkdir()
        for p in range(pp):
            lo = offsets[p]
            hi = offsets[p + 1] if p + 1 < pp else (num_layers or 0)
            stage = sorted((e for e in entries if self._on_stage(e, p, pp, lo, hi)),
                           key=_module_order)
            for t in range(tp):
                model = OrderedDict()
                for e in stage:
                    local_key = e.key if e.layer is None else _localize(e.key, e.layer - lo)
                    model[local_key] = self._local(request, e, t, tp, swiglu, torch)
                state = self._rank_state(request.common, model, tp, pp, num_layers)
                name = rank_dir_name(t, p, 0, pp, 1)
                for field_name, unique_key in per_rank.pop(name, {}).items():
                    state[field_name] = request.objects(unique_key)
                rank_dir = self.directory / iter_dir / name
                rank_dir.mkdir()
                torch.save(state, rank_dir / "model_optim_rng.pt")
        tracker = "release" if iteration is None else str(int(iteration))
        (self.directory / "latest_checkpointed_iteration.txt").write_text(tracker)
        dropped = [u for objs in per_rank.values() for u in objs.values()]
        dropped += [o.unique_key for o in request.meta.objects
                    if not _RANK_OBJECT_RE.match(o.unique_key)]
        if dropped:
            notes.append(f"dropped {len(dropped)} objects (e.g. {dropped[0]}): per-rank state "
                         "of another layout that legacy files cannot hold (rng state is reset)")
        return notes

    def _layout(self, summary: dict[str, Any]) -> tuple[int, int]:
        par = summary.get("parallel") or {}
        src_tp, src_pp = par.get("tp"), par.get("pp")
        tp = self.options.tp or src_tp or 1
        pp = self.options.pp or src_pp or 1
        if (src_tp and tp != src_tp) or (src_pp and pp != src_pp):
            raise UsageError(
                f"--tp {tp} --pp {pp} differs from the source layout (tp {src_tp}, pp {src_pp})",
                hint="convert keeps the layout; use 'ckpt reshard --to legacy' to change it")
        return int(tp), int(pp)

    @staticmethod
    def _num_layers(request: WriteRequest, summary: dict[str, Any]) -> int:
        n = (summary.get("model") or {}).get("num_layers")
        if n is None:
            from ckpt_tool.ops._reshard_io import as_namespace

            n = getattr(as_namespace(request.common.get("args")), "num_layers", None)
        if n is None:
            layers = [int(m.group(2)) for k in request.meta.tensors
                      if (m := LAYER_RE.match(k))]
            n = max(layers) + 1 if layers else 0
        return int(n)

    @staticmethod
    def _entries(request: WriteRequest, num_layers: int) -> list[_Entry]:
        out = []
        for key, t in request.meta.tensors.items():
            zero = (0,) * len(t.shape)
            m = LAYER_RE.match(key)
            if m is not None:
                out.append(_Entry(key, key, int(m.group(2)), zero, t.shape, False))
                continue
            s = _STACKED_RE.match(key)
            if s is not None and t.shape and t.shape[0] == num_layers:
                for layer in range(num_layers):
                    out.append(_Entry(f"{s.group(1)}{layer}.{s.group(2)}", key, layer,
                                      (layer,) + zero[1:], (1,) + tuple(t.shape[1:]), True))
                continue
            out.append(_Entry(key, key, None, zero, t.shape, False))
        return out

    @staticmethod
    def _on_stage(e: _Entry, p: int, pp: int, lo: int, hi: int) -> bool:
        if e.layer is not None:
            return lo <= e.layer < hi
        if e.key.startswith(_FIRST_STAGE) or ".embedding." in e.key:
            return p == 0
        return p == pp - 1  # final_layernorm, output_layer and other post-process modules

    @staticmethod
    def _local(request: WriteRequest, e: _Entry, t: int, tp: int, swiglu: bool,
               torch: Any) -> Any:
        shape = e.sizes[1:] if e.squeeze else e.sizes
        kind, dim = split_rule(e.key, swiglu=swiglu)
        lead = 1 if e.squeeze else 0

        def pull(rng_dim: int | None, start: int, size: int) -> Any:
            offs, sizes = list(e.offsets), list(e.sizes)
            if rng_dim is not None:
                offs[rng_dim + lead] += start
                sizes[rng_dim + lead] = size
            piece = request.source.read(e.target_key, tuple(offs), tuple(sizes))
            request.progress(piece.numel() * piece.element_size())
            return piece.reshape(piece.shape[1:]) if e.squeeze else piece

        if tp == 1 or kind == REPLICATED or not shape:
            return pull(None, 0, 0).clone()
        if kind == GLU:
            half = shape[0] // 2
            n = half // tp
            return torch.cat([pull(0, t * n, n), pull(0, half + t * n, n)]).clone()
        if shape[dim] % tp:
            raise UsageError(f"{e.key}: dim {dim} of size {shape[dim]} does not split over "
                             f"tp={tp}")
        n = shape[dim] // tp
        return pull(dim, t * n, n).clone()

    @staticmethod
    def _rank_state(common: dict[str, Any], model: dict[str, Any], tp: int, pp: int,
                    num_layers: int) -> dict[str, Any]:
        from ckpt_tool.ops._reshard_io import as_namespace

        args = as_namespace(common.get("args"))
        args.tensor_model_parallel_size = tp
        args.pipeline_model_parallel_size = pp
        if num_layers:
            args.num_layers = getattr(args, "num_layers", None) or num_layers
        state: dict[str, Any] = {"args": args,
                                 "checkpoint_version": common.get("checkpoint_version", 3.0)}
        for k in _COMMON_KEYS[1:]:
            if k in common:
                state[k] = common[k]
        state["model"] = model
        return state


_RANK_OBJECT_RE = re.compile(r"^(rng_state|opt_param_scheduler|optimizer)/(mp_rank_[0-9_]+)$")


def _per_rank_objects(request: WriteRequest) -> dict[str, dict[str, str]]:
    """Rank dir -> {state field: object unique key} for per-rank objects a legacy source had
    (``rng_state/mp_rank_00_001``): carried over when the output has the same rank dirs."""
    out: dict[str, dict[str, str]] = {}
    for o in request.meta.objects:
        m = _RANK_OBJECT_RE.match(o.unique_key)
        if m is not None:
            out.setdefault(m.group(2), {})[m.group(1)] = o.unique_key
    return out


def _module_order(e: _Entry) -> tuple[int, int, str]:
    """Embedding first, then layers in numeric order, then the post-process modules."""
    if e.layer is not None:
        return (1, e.layer, e.key)
    return (0 if e.key.startswith(_FIRST_STAGE) else 2, 0, e.key)


def _localize(key: str, local_layer: int) -> str:
    m = LAYER_RE.match(key)
    assert m is not None
    return f"{m.group(1)}{local_layer}{m.group(3)}"
