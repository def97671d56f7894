"""The reshard plan: the target checkpoint's metadata and, per target rank, which pieces of
which keys it holds and which source bytes it reads for them.

Call order::

    rules = load_rules(paths)                      # layout.py
    plan = plan_reshard(meta, Layout(tp=4, pp=1), rules, ReshardOptions(), common=common)
    plan.problems                                  # every reason / note (feasibility first)
    if plan.ok: for rank in plan.ranks: ...        # writers pull rank.tensors[i].pieces

Keys keep their source names (global layer numbers); ``TensorPlan.local_key`` is the name in a
per-rank legacy file (stage-local layer numbers). Dist targets write each chunk once (main
replica: tp rank 0 for replicated tensors, ep rank 0 for non-expert tensors); legacy targets
hold every local tensor on every rank that has it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta, split_chained
from ckpt_tool.planning.feasibility import (ERROR, NOTE, WARNING, Problem, check_layout,
                                            target_vocab_size, vocab_kept_unpadded)
from ckpt_tool.planning.grid import infer_rule_from_grid
from ckpt_tool.planning.layout import GLU, REPLICATED, VOCAB, Rule, RuleSet, example_rule, model_key
from ckpt_tool.planning.overlap import ChunkIndex, SourceRead, reads_for
from ckpt_tool.planning.pieces import LocalTensor, Piece, effective_kind, rank_pieces
from ckpt_tool.planning.rank_keys import EMBEDDING, OUTPUT, expert_of, local_key_of, stage_of
from ckpt_tool.planning.sizes import LayerMap, Layout, ModelSizes, rank_dir_name
from ckpt_tool.planning.source_layout import source_layout_from, source_layout_origins
from ckpt_tool.planning.source_model import (RESHARDABLE_OPTIMIZERS, OptimizerInfo,
                                             model_sizes_from, optimizer_info_from)

__all__ = ["ReshardOptions", "PiecePlan", "TensorPlan", "RankPlan", "ReshardPlan",
           "plan_reshard", "target_file", "RESHARD_ARGS"]

#: The ``args`` fields a reshard rewrites: the target's parallel sizes and padded vocabulary
#: (``ReshardPlan.args_updates``, the same names), and ``world_size`` (the source's data-parallel size times the
#: new tp x pp; ``ops.reshard``).
RESHARD_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size",
                "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                "decoder_last_pipeline_num_layers", "padded_vocab_size", "world_size")



@dataclass(frozen=True)
class ReshardOptions:
    """``target_format``: ``torch_dist`` or ``legacy``; ``vocab_fill``: ``copy`` (Megatron-LM's
    converter: new rows copy the last stored row) or ``zero``."""

    target_format: str = "torch_dist"
    drop_optimizer: bool = False
    make_vocab_size_divisible_by: int | None = None
    vocab_size: int | None = None
    vocab_fill: str = "copy"


@dataclass(frozen=True)
class PiecePlan:
    piece: Piece
    reads: tuple[SourceRead, ...] = ()


@dataclass(frozen=True)
class TensorPlan:
    """One local tensor (one stored chunk group) of ``key`` on a rank."""

    key: str
    local_key: str
    local_shape: tuple[int, ...]
    pieces: tuple[PiecePlan, ...]
    model_chunk: int | None = None


@dataclass
class RankPlan:
    rank: int
    tp: int
    pp: int
    ep: int
    file: str
    tensors: list[TensorPlan] = field(default_factory=list)

    def reads(self) -> list[SourceRead]:
        return [r for t in self.tensors for p in t.pieces for r in p.reads]

    def read_ranges(self) -> list[tuple[str | None, int | None, int | None]]:
        """Distinct ``(file, byte_offset, byte_length)`` this rank reads, sorted."""
        return sorted({(r.file, r.byte_offset, r.byte_length) for r in self.reads()},
                      key=lambda x: (x[0] or "", x[1] or 0, x[2] or 0))

    def read_bytes(self) -> int:
        return sum(n or 0 for _, _, n in self.read_ranges())

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "tp": self.tp, "pp": self.pp, "ep": self.ep,
                "file": self.file, "tensors": len(self.tensors),
                "read_bytes": self.read_bytes(),
                "reads": [{"file": f, "byte_offset": o, "byte_length": n}
                          for f, o, n in self.read_ranges()]}


@dataclass
class ReshardPlan:
    source: Layout
    target: Layout
    sizes: ModelSizes
    options: ReshardOptions
    problems: list[Problem]
    target_meta: CheckpointMeta | None = None
    ranks: list[RankPlan] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    args_updates: dict[str, Any] = field(default_factory=dict)
    optimizer: OptimizerInfo = field(default_factory=OptimizerInfo)
    source_origins: dict[str, str] = field(default_factory=dict)

    def optimizer_action(self) -> str:
        """What happens to the optimizer state (``--check`` says it)."""
        kind, legacy = self.optimizer.sharding, self.options.target_format == "legacy"
        if kind is None or self.options.drop_optimizer:
            return "none" if kind is None else "dropped"
        if kind in RESHARDABLE_OPTIMIZERS:
            return ("left out (legacy rank files cannot hold it)" if legacy else
                    "resharded with the model" if kind != "fully_sharded_model_space" else
                    "converted to model space (fully_reshardable) and resharded")
        refused = any(p.severity == ERROR and "optimizer" in p.reason for p in self.problems)
        return "refused" if refused else "copied unchanged"

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def to_dict(self, *, ranks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "source": {**self.source.to_dict(), "origins": self.source_origins},
            "target": self.target.to_dict(),
            "ok": self.ok, "problems": [p.to_dict() for p in self.problems],
            "dropped": self.dropped, "args_updates": self.args_updates,
            "optimizer": {**self.optimizer.to_dict(), "action": self.optimizer_action()}}
        if ranks:
            d["ranks"] = [r.to_dict() for r in self.ranks]
        return d


def target_file(fmt: str, target: Layout, tp: int, pp: int, ep: int) -> tuple[int, str]:
    """``(global rank, file)`` of target rank (tp, pp, ep); ranks ordered tp-ep-pp (data
    parallel = expert parallel, Megatron-Core's default order)."""
    rank = tp + target.tp * ep + target.tp * target.ep * pp
    if fmt == "legacy":
        return rank, f"{rank_dir_name(tp, pp, ep, target.pp, target.ep)}/model_optim_rng.pt"
    return rank, f"__{rank}_0.distcp"


def _resolve_rules(meta: CheckpointMeta, rules: RuleSet, source: Layout, skip: set[str],
                   problems: list[Problem], per_rank_target: bool = False) -> dict[str, Rule]:
    """The rule of every key not in ``skip``; an error problem for each key without one.

    A key no rule knows takes the split its source chunk grid shows only for a dist target
    (the global tensor is what a dist checkpoint stores: its chunking moves no value); a
    per-rank target (legacy files) needs what each rank's module holds, which a grid cannot
    tell of a part we do not know (a fused or per-component layout looks like a plain split):
    refused by name."""
    out: dict[str, Rule] = {}
    unknown: list[str] = []
    for key, t in meta.tensors.items():
        if key in skip:
            continue
        rule = rules.find(key)
        if rule is not None and rule.grid_first and meta.format not in ("legacy",):
            rule = infer_rule_from_grid(t, source.tp) or rule
        elif rule is None and meta.format not in ("legacy",) and not per_rank_target:
            rule = infer_rule_from_grid(t, source.tp)
        if rule is None:
            unknown.append(key)
            continue
        out[key] = rule
    if len(unknown) > _UNKNOWN_LISTED:  # one problem, not a page of them
        shown = ", ".join(repr(k) for k in unknown[:3])
        problems.append(Problem(
            ERROR, f"no layout rule knows how {plural(len(unknown), 'key')} split across "
            "tensor-parallel "
            f"ranks, and their chunk grids cannot tell ({shown}, ...): is this a "
            "Megatron-Core GPT-family checkpoint?",
            "add rules to the --rules TOML file, e.g.\n" + example_rule(unknown[0]),
            key=unknown[0], unsupported=True))
        return out
    for key in unknown:
        problems.append(Problem(ERROR, f"no layout rule knows how {key!r} splits across "
                                "tensor-parallel ranks, and its chunk grid cannot tell",
                                "add a rule to the --rules TOML file, e.g.\n"
                                + example_rule(key), key=key, unsupported=True))
    return out


_UNKNOWN_LISTED = 5  # more unknown keys than this are reported as one problem


def plan_reshard(meta: CheckpointMeta, target: Layout, rules: RuleSet | None = None,
                 options: ReshardOptions | None = None,
                 common: Mapping[str, Any] | None = None) -> ReshardPlan:
    """Feasibility, then (when feasible) the target metadata and every rank's pieces/reads."""
    rules = rules or RuleSet()
    options = options or ReshardOptions()
    sizes = model_sizes_from(meta, common)
    if options.vocab_size is not None:
        sizes = sizes.with_(vocab_size=options.vocab_size)
    if options.make_vocab_size_divisible_by is not None:
        sizes = sizes.with_(make_vocab_size_divisible_by=options.make_vocab_size_divisible_by)
    source = source_layout_from(meta, common)
    origins = source_layout_origins(meta, common)
    known = origins["tp"] != "unknown" and origins["pp"] != "unknown"
    vocab_note = None
    if options.vocab_size is None and options.make_vocab_size_divisible_by is None:
        sizes, vocab_note = vocab_kept_unpadded(
            sizes, meta, common, source.tp if origins["tp"] != "unknown" else None, target.tp)
    opt: OptimizerInfo = optimizer_info_from(meta)
    problems = check_layout(sizes, target, opt, meta.objects, source=source if known else None,
                            drop_optimizer=options.drop_optimizer,
                            vocab_fill=options.vocab_fill)
    if vocab_note is not None:
        problems.insert(0, vocab_note)
    if (options.target_format == "legacy" and opt.sharding in RESHARDABLE_OPTIMIZERS
            and not options.drop_optimizer):
        problems.append(Problem(WARNING, f"legacy rank files cannot hold the {opt.describe()}:"
                                f" its {plural(len(opt.keys), 'tensor')} "
                                f"{'is' if len(opt.keys) == 1 else 'are'} left out",
                                "resume with --no-load-optim, or reshard to torch_dist",
                                key="optimizer"))
    plan = ReshardPlan(source, target, sizes, options, problems, optimizer=opt,
                       source_origins=origins)
    drop_opt = options.drop_optimizer
    opt_keys = set(opt.keys)
    skip = opt_keys if drop_opt else {k for k in opt_keys
                                      if split_chained(k)[1].startswith("optimizer.distributed.")}
    rule_of = _resolve_rules(meta, rules, source, skip, problems,
                             per_rank_target=options.target_format == "legacy")
    if not plan.ok or sizes.num_layers is None:
        return plan
    lm = LayerMap(sizes.num_layers, target)
    new_vocab = target_vocab_size(sizes, target.tp)
    plan.args_updates = {
        "tensor_model_parallel_size": target.tp, "pipeline_model_parallel_size": target.pp,
        "expert_model_parallel_size": target.ep, "expert_tensor_parallel_size": target.expert_tp,
        "virtual_pipeline_model_parallel_size": target.vpp,
        "decoder_first_pipeline_num_layers": target.first_stage_layers,
        "decoder_last_pipeline_num_layers": target.last_stage_layers,
        "padded_vocab_size": new_vocab}
    legacy = options.target_format == "legacy"
    ranks: dict[tuple[int, int, int], RankPlan] = {}
    for t, p, e in target.model_parallel_ranks:
        r, f = target_file(options.target_format, target, t, p, e)
        ranks[(t, p, e)] = RankPlan(r, t, p, e, f)
    new_tensors: dict[str, TensorMeta] = {}
    for key, tmeta in meta.tensors.items():
        if key in opt_keys and drop_opt:
            plan.dropped.append(key)
            continue
        if key not in rule_of:
            new_tensors[key] = _copy_as_stored(tmeta, ranks, target, options, key)
            continue
        new_tensors[key] = _plan_key(key, tmeta, rule_of[key], sizes, target, lm, ranks,
                                     legacy, new_vocab, options)
        if legacy and target.pp > 1 and key == EMBEDDING and OUTPUT not in meta.tensors:
            # tied embeddings: Megatron-LM's last stage holds (and loads) its own copy
            _plan_key(key, tmeta, rule_of[key], sizes, target, lm, ranks, legacy, new_vocab,
                      options, alias=OUTPUT)
    plan.ranks = [ranks[k] for k in sorted(ranks, key=lambda k: ranks[k].rank)]
    objects = _plan_objects(meta, plan, lm, ranks, legacy)
    plan.target_meta = CheckpointMeta(
        format=options.target_format, root="", tensors=new_tensors, objects=tuple(objects),
        common={**meta.common, "parallel": {"tp": target.tp, "pp": target.pp, "ep": target.ep,
                                             "etp": target.expert_tp}},
        extras={"resharded_from": source.to_dict()}, version=meta.version)
    return plan


def _plan_key(key: str, tmeta: TensorMeta, rule: Rule, sizes: ModelSizes, target: Layout,
              lm: LayerMap, ranks: dict[tuple[int, int, int], RankPlan], legacy: bool,
              new_vocab: int | None, options: ReshardOptions, alias: str | None = None
              ) -> TensorMeta:
    """Every target rank's local tensor of ``key``; ``alias``: planned as the rank files name
    it under that key instead (placed and named as ``alias``, read from ``key``)."""
    shape = list(tmeta.shape)
    source_rows = None
    if rule.kind == VOCAB and new_vocab is not None:
        source_rows = shape[0]
        shape[0] = new_vocab
    index = ChunkIndex(tmeta)
    glu = effective_kind(rule, sizes.gated_linear_unit) == GLU
    where = stage_of(alias or key, lm, target.pp)
    n_exp = sizes.num_experts or 0
    chunks: list[ChunkRef] = []
    for (t, p, e), rp in ranks.items():
        if where is not None and where[0] != p:
            continue
        layers = lm.layers_of(p) if where is None else None
        ttp, trank, local_expert = target.tp, t, None
        if rule.expert:
            ttp = target.expert_tp
            if t >= ttp:
                continue
            trank = t
            per = n_exp // target.ep if n_exp else 0
            experts = list(range(e * per, (e + 1) * per)) if per else None
            g = expert_of(model_key(key))
            if g is not None and per:
                if not e * per <= g < (e + 1) * per:
                    continue
                local_expert = g - e * per
        else:
            experts = None
            if e and not legacy:
                continue
        if not legacy and rule.kind == REPLICATED and t != 0:
            continue
        locals_ = rank_pieces(key, shape, rule, tp=ttp, tp_rank=trank,
                              gated=sizes.gated_linear_unit, layers=layers, experts=experts,
                              source_rows=source_rows, fill=options.vocab_fill)
        for lt in locals_:
            pieces = []
            for pc in lt.pieces:
                reads = () if pc.fill else tuple(reads_for(index, pc.global_offsets, pc.sizes))
                pieces.append(PiecePlan(pc, reads))
            chunks.extend(ChunkRef(o, z, file=rp.file) for o, z in _chunk_boxes(lt, glu))
            local_layer = where[2] if where is not None else -1
            vp = where[1] if where is not None and lm.vpp > 1 else None
            local_key = local_key_of(alias or key, local_layer, local_expert)
            rp.tensors.append(TensorPlan(key, local_key, lt.local_shape, tuple(pieces), vp))
    if legacy:
        chunks = list({(c.offsets, c.sizes): c for c in chunks}.values())
    return TensorMeta(key=key, dtype=tmeta.dtype, shape=tuple(shape), chunks=tuple(chunks),
                      origin=rule.kind)


def _chunk_boxes(lt: LocalTensor, glu: bool) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The stored chunks of one local tensor: each GLU half separately (Megatron-Core's
    swiglu factory), else the local tensor's box (vocab fill rows included)."""
    if glu:
        return [(p.global_offsets, p.sizes) for p in lt.pieces]
    lo = tuple(min(p.global_offsets[i] for p in lt.pieces) for i in range(len(lt.local_shape)))
    return [(lo, lt.local_shape)]


def _copy_as_stored(tmeta: TensorMeta, ranks: dict[tuple[int, int, int], RankPlan],
                    target: Layout, options: ReshardOptions, key: str) -> TensorMeta:
    """A dp-only optimizer tensor at an unchanged layout: each chunk to the rank that wrote
    it (``__{rank}_{i}.distcp``)."""
    by_rank = {rp.rank: rp for rp in ranks.values()}
    index = ChunkIndex(tmeta)
    chunks = []
    for c in tmeta.chunks:
        m = re.match(r"^__(\d+)_", c.file or "")
        rp = by_rank.get(int(m.group(1)) if m else 0) or by_rank[0]
        piece = Piece(c.offsets, c.sizes, (0,) * len(c.offsets))
        rp.tensors.append(TensorPlan(key, key, c.sizes, (PiecePlan(piece, tuple(
            reads_for(index, c.offsets, c.sizes))),)))
        chunks.append(ChunkRef(c.offsets, c.sizes, file=rp.file))
    return replace(tmeta, chunks=tuple(chunks))


def _plan_objects(meta: CheckpointMeta, plan: ReshardPlan, lm: LayerMap,
                  ranks: dict[tuple[int, int, int], RankPlan], legacy: bool) -> list[ObjectMeta]:
    """Objects kept (re-filed to the rank that writes them) and dropped (recorded)."""
    src, tgt = plan.source, plan.target
    same_tp_pp = (src.tp, src.pp) == (tgt.tp, tgt.pp) and "unknown" not in (
        plan.source_origins.get("tp"), plan.source_origins.get("pp"))
    out: list[ObjectMeta] = []
    for o in meta.objects:
        if o.key == "rng_state" and not same_tp_pp:
            plan.dropped.append(o.unique_key)
        elif o.key in ("optimizer", "distrib_optim") or split_chained(o.key)[1].startswith(
                "optimizer."):
            if plan.options.drop_optimizer or not same_tp_pp:
                plan.dropped.append(o.unique_key)
            else:
                out.append(o)
        elif o.key.endswith("_extra_state") and not legacy:
            layer = o.global_offset[0] if o.global_offset else 0
            where = stage_of(o.key, lm, tgt.pp) or lm.locate(min(layer, lm.num_layers - 1))
            rp = ranks[(0, where[0], 0)]
            out.append(replace(o, file=rp.file, byte_offset=None, byte_length=None))
        elif o.key in ("opt_param_scheduler",) and legacy:
            continue  # one per target rank below
        else:
            out.append(o)
    if legacy and any(o.key == "opt_param_scheduler" for o in meta.objects):
        first = next(o for o in meta.objects if o.key == "opt_param_scheduler")
        for rp in ranks.values():
            out.append(ObjectMeta("opt_param_scheduler",
                                  f"opt_param_scheduler/{rp.file.split('/')[0]}", rp.file))
        plan.problems.append(Problem(NOTE, "opt_param_scheduler copied from "
                                     f"{first.unique_key} to every target rank file"))
    return out
