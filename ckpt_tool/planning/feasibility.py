"""Can a checkpoint be resharded to a target layout? Every reason it cannot, each with its fix.

The model rules are the ones Megatron-Core's ``TransformerConfig.__post_init__`` (0.16) and its
parallel layers enforce: tp divides ``num_attention_heads``; ``num_query_groups`` is a multiple
or a divisor of tp; the fused QKV, ``ffn_hidden_size`` (``ColumnParallelLinear`` /
``RowParallelLinear`` ``divide``) and the re-padded vocab split evenly; the pipeline stages
(with ``decoder_first/last_pipeline_num_layers`` and virtual stages) split the layers; ep
divides the number of experts. Plus what the checkpoint itself allows: the optimizer sharding
type and the ShardedObjects keyed by the old layout. The model's sizes and the optimizer
state's form are read from the metadata by ``source_model`` (re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ckpt_tool.errors import plural
from ckpt_tool.model import CheckpointMeta, Finding, ObjectMeta
from ckpt_tool.planning.sizes import Layout, ModelSizes, padded_vocab_size, stage_layer_counts
from ckpt_tool.planning.source_layout import args_of
from ckpt_tool.planning.source_model import NON_DISTRIBUTED, RESHARDABLE_OPTIMIZERS, OptimizerInfo

__all__ = ["Problem", "vocab_kept_unpadded", "target_vocab_size", "check_layout", "valid_tps",
           "ERROR", "WARNING", "NOTE"]

ERROR, WARNING, NOTE = "error", "warning", "note"


@dataclass(frozen=True)
class Problem:
    """One reason (``error``), risk (``warning``) or change the reshard makes (``note``), with
    what to do about it."""

    severity: str
    reason: str
    fix: str | None = None
    key: str | None = None
    #: the input holds something this tool does not know (a model part no rule places):
    #: the command exits 2, as for any input it cannot handle, not 1 (a plan's finding)
    unsupported: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = {"severity": self.severity, "reason": self.reason, "fix": self.fix,
             "key": self.key}
        if self.unsupported:
            d["unsupported"] = True
        return d

    def to_finding(self) -> Finding:
        msg = self.reason if not self.fix else f"{self.reason} — fix: {self.fix}"
        return Finding("warning" if self.severity == NOTE else self.severity, self.key, None,
                       msg)


def vocab_kept_unpadded(model: ModelSizes, meta: CheckpointMeta,
                        common: Mapping[str, Any] | None, source_tp: int | None,
                        target_tp: int) -> tuple[ModelSizes, Problem | None]:
    """Without ``args`` (no vocab size, no padding multiple), stored vocab rows that are not
    a multiple of Megatron-LM's padding (``make_vocab_size_divisible_by`` 128 x the old tp)
    were not padded by Megatron-LM: keep them when the new tp divides them; else an error that
    names the flags that decide."""
    args = args_of(meta, common)
    rows = model.padded_vocab_size
    if rows is None or args.get("vocab_size") or args.get("make_vocab_size_divisible_by"):
        return model, None
    mult = model.make_vocab_size_divisible_by * (source_tp or 1)
    if rows % mult == 0:
        return model, None
    if rows % target_tp == 0:
        return model.with_(vocab_size=rows, make_vocab_size_divisible_by=1), Problem(
            NOTE, f"vocab rows {rows} kept: no args, and {rows} is not a multiple of "
            f"{mult} (make_vocab_size_divisible_by {model.make_vocab_size_divisible_by} x tp "
            f"{source_tp or 1}), so not Megatron-LM's padding; tp={target_tp} divides them",
            "pass --vocab-size / --make-vocab-size-divisible-by to pad instead", key="vocab")
    return model, Problem(
        ERROR, f"the stored vocab rows ({rows}, no args) are not Megatron-LM-padded (not a "
        f"multiple of {mult}) and tp={target_tp} does not divide them",
        "pass --vocab-size (the tokenizer's vocab; rows become a multiple of "
        "--make-vocab-size-divisible-by x tp, default 128) or --make-vocab-size-divisible-by "
        f"with a value that makes {rows} rows split over tp={target_tp}", key="vocab")


def target_vocab_size(model: ModelSizes, tp: int, divisible_by: int | None = None) -> int | None:
    """The padded vocab at ``tp``: from the true vocab when known, else from the stored
    padded vocab (never smaller than it)."""
    base = model.vocab_size or model.padded_vocab_size
    if base is None:
        return None
    return padded_vocab_size(int(base), tp, divisible_by or model.make_vocab_size_divisible_by)


def _tp_ok(model: ModelSizes, tp: int) -> bool:
    heads, groups = model.num_attention_heads, model.num_query_groups
    return not ((heads and heads % tp) or (groups and groups % tp and tp % groups)
                or (model.qkv_rows and model.qkv_rows % tp)
                or (model.ffn_hidden_size and model.ffn_hidden_size % tp))


def valid_tps(model: ModelSizes, limit: int = 1024) -> list[int]:
    """Every tensor-parallel size (up to the head count) the model's sizes allow."""
    top = min(model.num_attention_heads or limit, limit)
    return [t for t in range(1, top + 1) if _tp_ok(model, t)]


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(model: ModelSizes, target: Layout, optimizer: OptimizerInfo | None = None,
                 objects: Iterable[ObjectMeta] = (), *, source: Layout | None = None,
                 drop_optimizer: bool = False, divisible_by: int | None = None,
                 vocab_fill: str = "copy") -> list[Problem]:
    """Every reason ``target`` cannot hold ``model`` (errors, each with its fix), then the
    warnings and the notes on what the reshard changes (re-padding, objects)."""
    out: list[Problem] = []
    tp, pp, ep = target.tp, target.pp, target.ep
    heads, groups = model.num_attention_heads, model.num_query_groups
    if min(tp, pp, ep, target.expert_tp) < 1:
        out.append(Problem(ERROR, f"parallel sizes must be >= 1 (tp={tp} pp={pp} ep={ep})",
                           "pass positive sizes"))
        return out
    fix = f"choose tp among {', '.join(map(str, valid_tps(model)))}"
    if heads and heads % tp:
        out.append(Problem(ERROR, f"num_attention_heads ({heads}) is not a multiple of tp "
                           f"({tp})", fix))
    if groups and groups % tp and tp % groups:
        out.append(Problem(ERROR, f"num_query_groups ({groups}) is neither a multiple nor a "
                           f"divisor of tp ({tp})", fix))
    elif groups and tp > groups:
        out.append(Problem(NOTE, f"tp ({tp}) > num_query_groups ({groups}): each rank holds an "
                           f"even 1/{tp} slice of the fused QKV rows (Megatron-Core all-gathers "
                           "QKV and picks its heads at run time)", None, key="linear_qkv"))
    rows = model.qkv_rows
    if rows and rows % tp:
        out.append(Problem(ERROR, f"the fused QKV has {rows} rows, not divisible by tp ({tp})",
                           fix, key="linear_qkv"))
    ffn = model.ffn_hidden_size
    if ffn and ffn % tp:
        out.append(Problem(ERROR, f"ffn_hidden_size ({ffn}) is not divisible by tp ({tp})",
                           fix, key="linear_fc1"))
    _check_vocab(out, model, target, source, divisible_by, vocab_fill)
    _check_pipeline(out, model, target)
    _check_experts(out, model, target)
    _check_optimizer(out, optimizer or OptimizerInfo(), target, source, drop_optimizer)
    _check_objects(out, list(objects), target, source)
    return out


def _check_vocab(out: list[Problem], model: ModelSizes, target: Layout, source: Layout | None,
                 divisible_by: int | None, fill: str) -> None:
    src = model.padded_vocab_size
    new = target_vocab_size(model, target.tp, divisible_by)
    if src is None or new is None:
        out.append(Problem(WARNING, "vocab size unknown (no args, no embedding)",
                           "pass --vocab-size"))
        return
    if new % target.tp:
        out.append(Problem(ERROR, f"padded vocab {new} is not divisible by tp ({target.tp})",
                           "pass --make-vocab-size-divisible-by with a value that tp divides"))
    mult = (divisible_by or model.make_vocab_size_divisible_by) * target.tp
    if model.vocab_size is None and src > mult:
        out.append(Problem(WARNING, f"the tokenizer's vocab size is unknown: keeping {new} rows "
                           f"(the stored {src} padded for tp={target.tp}); Megatron-LM pads the "
                           f"tokenizer's vocab to a multiple of {mult}, which may give fewer "
                           "rows and a shape mismatch at load",
                           "pass --vocab-size (the tokenizer's)", key="vocab"))
    if new == src:
        return
    how = ("new rows are copies of the last stored row, as Megatron-LM's checkpoint converter "
           "pads" if fill == "copy" else "new rows are zeros")
    if new > src:
        out.append(Problem(NOTE, f"padded vocab {src} -> {new} at tp={target.tp}: embedding and "
                           f"output layer re-padded; {how}", None, key="vocab"))
    else:
        out.append(Problem(NOTE, f"padded vocab {src} -> {new} at tp={target.tp}: padding rows "
                           f"{new}..{src - 1} dropped", None, key="vocab"))


def _check_pipeline(out: list[Problem], model: ModelSizes, target: Layout) -> None:
    n = model.num_layers
    if n is None:
        out.append(Problem(ERROR, "cannot place layers on pipeline stages: the number of "
                           "layers is unknown (no args, no layer keys)",
                           "reshard a checkpoint whose common state holds args.num_layers"))
        return
    for name, v in (("--decoder-first-pipeline-num-layers", target.first_stage_layers),
                    ("--decoder-last-pipeline-num-layers", target.last_stage_layers)):
        if v is not None and v <= 0:
            out.append(Problem(ERROR, f"{name} must be > 0 (got {v})", f"drop {name}"))
            return
    try:
        counts = stage_layer_counts(n, target.pp, target.first_stage_layers,
                                    target.last_stage_layers)
    except ValueError as exc:
        fix = (f"choose pp among {_divisors(n)}, or set --decoder-first-pipeline-num-layers / "
               "--decoder-last-pipeline-num-layers so the middle stages split evenly")
        out.append(Problem(ERROR, f"pp={target.pp} cannot hold {n} layers: {exc}", fix))
        return
    vpp = target.vpp or 1
    bad = [c for c in counts if c % vpp]
    if bad:
        out.append(Problem(ERROR, f"stage layer counts {counts} do not split over {vpp} "
                           "virtual pipeline stages", "choose a vpp dividing every stage's "
                           "layer count"))
    if any(c == 0 for c in counts):
        out.append(Problem(WARNING, f"stage layer counts {counts}: a stage without layers",
                           "use fewer pipeline stages"))


def _check_experts(out: list[Problem], model: ModelSizes, target: Layout) -> None:
    e = model.num_experts
    if target.ep > 1 and not e:
        out.append(Problem(ERROR, f"ep={target.ep} but the model has no experts", "use ep=1"))
    elif e and e % target.ep:
        out.append(Problem(ERROR, f"ep ({target.ep}) does not divide the {e} experts",
                           f"choose ep among {_divisors(e)}"))
    ffn = model.moe_ffn_hidden_size
    if e and ffn and ffn % target.expert_tp:
        out.append(Problem(ERROR, f"moe_ffn_hidden_size ({ffn}) is not divisible by the expert "
                           f"tensor parallel size ({target.expert_tp})",
                           f"choose etp among {_divisors(ffn)}"))


def _check_optimizer(out: list[Problem], opt: OptimizerInfo, target: Layout,
                     source: Layout | None, drop: bool) -> None:
    kind = opt.sharding
    if kind is None:
        if opt.claimed:
            out.append(Problem(NOTE, "no optimizer state (no optimizer.* keys; the content "
                               f"metadata's '{opt.claimed}' is what Megatron-LM writes into "
                               "every checkpoint): nothing to reshard or drop", None,
                               key="optimizer"))
        return
    if drop:
        out.append(Problem(NOTE, f"optimizer state ({opt.describe()}) dropped "
                           "(--drop-optimizer)", key="optimizer"))
        return
    if kind == "fully_sharded_model_space":
        out.append(Problem(NOTE, "optimizer state fully_sharded_model_space (flattened) is "
                           "converted to model space (fully_reshardable)", key="optimizer"))
        return
    if kind in RESHARDABLE_OPTIMIZERS:
        said = (f"; the content metadata's '{opt.claimed}' is kept: Megatron-Core's "
                "non-distributed optimizers ignore it" if kind == NON_DISTRIBUTED and
                opt.claimed else "")
        if opt.source and opt.source.startswith("unflattened"):
            said = (f"; {opt.source}; written as fully_reshardable, which Megatron-Core loads "
                    "at any layout")
        out.append(Problem(NOTE, f"optimizer state: {opt.describe()}, {len(opt.keys)} "
                           f"tensors resharded with the model (same split as each "
                           f"parameter){said}", None, key="optimizer"))
        return
    changed = source is None or (source.tp, source.pp, source.expert_tp, source.ep) != (
        target.tp, target.pp, target.expert_tp, target.ep)
    if not changed:
        out.append(Problem(NOTE, f"optimizer state ({kind}) copied unchanged (same tp/pp/ep)"))
        return
    why = {"dp_reshardable": "its per-bucket flat buffers follow the old tp/pp gradient "
                             "buckets",
           "dp_zero_gather_scatter": "its param_state object follows the old tp/pp gradient "
                                     "buckets",
           "legacy_distrib_optim": "distrib_optim.pt holds flat DP shards of the old tp/pp "
                                   "gradient buffers",
           "legacy_optimizer": "the per-rank optimizer state is keyed by the old ranks' "
                               "parameter order"}.get(kind, "it is not model-space sharded")
    out.append(Problem(ERROR, f"optimizer state '{kind}' cannot change tp/pp/ep from the "
                       f"checkpoint alone: {why}, which needs the model's parameter-to-bucket "
                       "mapping of both layouts",
                       "pass --drop-optimizer (training restarts the optimizer), or re-save "
                       "with --dist-ckpt-optim-fully-reshardable and reshard that"))


def _check_objects(out: list[Problem], objects: list[ObjectMeta], target: Layout,
                   source: Layout | None) -> None:
    rng = [o for o in objects if o.key == "rng_state"]
    same = source is not None and (source.tp, source.pp) == (target.tp, target.pp)
    if rng and not same:
        out.append(Problem(NOTE, f"{plural(len(rng), 'rng_state object')} keyed by the old "
                           "(pp, tp) dropped: train with --no-load-rng (as Megatron-LM does on a TP/PP "
                           "change)", None, key="rng_state"))
    extra = sorted({o.key for o in objects if o.key.endswith("_extra_state")})
    if extra:
        out.append(Problem(NOTE, f"{plural(len(extra), 'per-layer _extra_state key')} kept: "
                           "keyed by global layer, which a new tp/pp does not change (legacy targets "
                           "store them under stage-local layer numbers)", None,
                           key="_extra_state"))
