"""``ckpt reshard SRC DST --tp N --pp M [--ep E]``: a checkpoint ready to resume at another layout."""

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ckpt_tool.cli._errors import handle_errors, state
from ckpt_tool.cli._options import (DebugFlag, IterationOption, JsonFlag, NoProgressFlag,
                                    NoVerifyFlag, OverwriteFlag, QuietFlag, SourcePath,
                                    SwigluOption, TrustFlag, VerboseFlag, VerifyOption, completer,
                                    source_place, verify_level)
from ckpt_tool.cli._output import human_bytes, message, print_json, print_resume, print_text
from ckpt_tool.cli._progress import progress_bar
from ckpt_tool.errors import plural

_Int = Optional[int]


@handle_errors
def reshard(
    src: SourcePath,
    dst: Annotated[Optional[Path], typer.Argument(
        metavar="DST",
        help="Output directory (not needed with --check/--dry-run).", show_default=False)] = None,
    tp: Annotated[_Int, typer.Option("--tp", min=1, metavar="N", show_default=False,
                                     help="Target tensor-parallel size (default: the "
                                     "source's).")] = None,
    pp: Annotated[_Int, typer.Option("--pp", min=1, metavar="N", show_default=False,
                                     help="Target pipeline-parallel size (default: the "
                                     "source's).")] = None,
    ep: Annotated[_Int, typer.Option("--ep", min=1, metavar="N", show_default=False,
                                     help="Target expert-parallel size (default: the "
                                     "source's).")] = None,
    etp: Annotated[_Int, typer.Option("--etp", min=1, metavar="N", show_default=False,
                                      help="Target expert tensor-parallel size (default: "
                                      "--tp).")] = None,
    vpp: Annotated[_Int, typer.Option("--vpp", min=1, metavar="N", show_default=False,
                                      help="Virtual pipeline stages per rank (legacy "
                                      "targets).")] = None,
    first_layers: Annotated[_Int, typer.Option(
        "--decoder-first-pipeline-num-layers", min=0, metavar="N", show_default=False,
        help="Layers on the first pipeline stage.")] = None,
    last_layers: Annotated[_Int, typer.Option(
        "--decoder-last-pipeline-num-layers", min=0, metavar="N", show_default=False,
        help="Layers on the last pipeline stage.")] = None,
    to: Annotated[Optional[str], typer.Option(
        "--to", metavar="FORMAT", show_default=False,
        autocompletion=completer("torch_dist", "legacy"),
        help="Target format: torch_dist or legacy (default: torch_dist for dist input, legacy "
        "for legacy input).")] = None,
    rules: Annotated[Optional[List[Path]], typer.Option(
        "--rules", metavar="FILE",
        help="TOML file of layout rules that add to / override the built-in ones "
        "(repeatable).", show_default=False)] = None,
    drop_optimizer: Annotated[bool, typer.Option(
        "--drop-optimizer", help="Leave optimizer state out (needed for optimizer state "
        "sharded over DP when tp/pp change).")] = False,
    divisible_by: Annotated[_Int, typer.Option(
        "--make-vocab-size-divisible-by", min=1, metavar="N", show_default=False,
        help="Vocab padding multiple (default: from the checkpoint's args).")] = None,
    vocab_size: Annotated[_Int, typer.Option(
        "--vocab-size", min=1, metavar="N", show_default=False,
        help="The tokenizer's (unpadded) vocab size, when the args lack it.")] = None,
    vocab_fill: Annotated[str, typer.Option(
        "--vocab-fill", metavar="copy|zero", autocompletion=completer("copy", "zero"),
        help="New padded vocab rows: copy (the last row, as Megatron-LM's "
        "converter) or zero.")] = "copy",
    local_spec: Annotated[Optional[bool], typer.Option(
        "--local-spec/--te-spec", show_default=False,
        help="The model's layer spec (--transformer-impl local or transformer_engine): the "
        "parameter order of DistributedOptimizer buckets, and for legacy targets the layer "
        "norm names (input_layernorm.*, pre_mlp_layernorm.* or the fused ones) (default: "
        "from the checkpoint's configuration).")] = None,
    ddp_bucket_size: Annotated[_Int, typer.Option(
        "--ddp-bucket-size", min=0, metavar="N", show_default=False,
        help="The DDP bucket size in elements the source was trained with (0: "
        "overlap_grad_reduce off, one bucket per buffer), where its configuration lacks it "
        "and its optimizer form stores no bucket sizes (dp_zero_gather_scatter).")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="Only report whether the target layout can work (and why not).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Also print the plan: per target rank, which source bytes it reads; "
        "write nothing.")] = False,
    workers: Annotated[int, typer.Option(
        "--workers", min=1, metavar="N", help="Target rank files written at once by I/O threads "
        "(torch_dist targets).")] = 1,
    overwrite: OverwriteFlag = False,
    no_verify: NoVerifyFlag = False,
    verify: VerifyOption = "written",
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    iteration: IterationOption = None,
    quiet: QuietFlag = False,
    verbose: VerboseFlag = False,
    no_progress: NoProgressFlag = False,
    swiglu: SwigluOption = None,
    debug: DebugFlag = False,
) -> None:
    """Rewrite a checkpoint for another TP/PP/EP layout (feasibility is checked first: every
    reason the target cannot work is reported with its fix; exit 1 then). Sizes not given keep
    the source's. A training save directory gives a save directory (an iter_* directory an
    iter_* directory inside DST); the last lines say how to resume (docs/resume.md).

    \b
    Examples:
      ckpt reshard fixtures/mcore016_gpt_tp2pp2_fp32 gpt-tp4 --tp 4
      ckpt reshard fixtures/mcore016_gpt_tp2pp2_fp32 --pp 4 --check
    """
    from ckpt_tool.errors import UsageError
    from ckpt_tool.ops.reshard import ReshardRequest
    from ckpt_tool.ops.reshard import reshard as run_reshard

    if vocab_fill not in ("copy", "zero"):
        raise UsageError(f"bad --vocab-fill {vocab_fill!r}", hint="use copy or zero")
    place = source_place(src, iteration)
    req = ReshardRequest(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, first_stage_layers=first_layers,
                         last_stage_layers=last_layers, to=to,
                         rules=tuple(str(r) for r in rules or ()),
                         drop_optimizer=drop_optimizer,
                         make_vocab_size_divisible_by=divisible_by, vocab_size=vocab_size,
                         vocab_fill=vocab_fill, local_spec=local_spec,
                         ddp_bucket_size=ddp_bucket_size)
    with progress_bar("reshard", enabled=not (check or dry_run or quiet or no_progress)) as bar:
        result = run_reshard(place, dst, req, check=check, dry_run=dry_run, trust=trust,
                             overwrite=overwrite, verify=verify_level(verify, no_verify),
                             verify_source=not no_verify, progress=bar,
                             workers=workers)
    state.verdict = 0 if result.ok else 1  # kept if stdout's reader goes away
    problems = result.plan.get("problems") or []
    if json_:
        print_json(result.to_dict())
    elif dry_run or verbose:
        _render(result.plan, show_ranks=dry_run)
    elif not result.ok:  # what stops it, each with its fix; what it would change: --verbose
        _print_problems([p for p in problems if p["severity"] != "note"])
    elif check or (not quiet and _to_act_on(problems)):
        _render(result.plan, show_ranks=False)
    else:  # a reshard that went through: what it changed, one message each (none with -q)
        for p in problems:
            message(_problem_line(p), failure=p["severity"] == "error")
    for note in getattr(result, "notes", None) or ():
        if note.startswith(("reclaimed", "--no-verify")):  # (the others: the feasibility table)
            message(f"note: {note}")
    message(_verdict(result, check or dry_run), failure=not result.ok)
    print_resume(result.resume)
    if not result.ok:  # a part no rule places: exit 2 (input not handled), else a finding
        raise typer.Exit(2 if any(p.get("unsupported") for p in problems) else 1)


def _to_act_on(problems: list[dict[str, Any]]) -> bool:
    """The feasibility table is worth a table when a row asks for something: an error, a
    warning, or a fix to apply; rows that only say what the reshard changes are notes."""
    return any(p["severity"] != "note" or p.get("fix") for p in problems)


def _print_problems(problems: list[dict[str, Any]]) -> None:
    """One line per problem, those with the same fix together and the fix once after them,
    on a line of its own (errors also with --quiet)."""
    by_fix: dict[str, list[dict[str, Any]]] = {}
    for p in problems:
        by_fix.setdefault(p.get("fix") or "", []).append(p)
    for fix, group in by_fix.items():
        for p in group:
            key = f"{p['key']}: " if p.get("key") else ""
            message(f"{p['severity']}: {key}{p['reason']}", failure=p["severity"] == "error")
        if fix:
            message(f"  fix: {fix}", failure=any(p["severity"] == "error" for p in group))


def _problem_line(p: dict[str, Any]) -> str:
    key = f"{p['key']}: " if p.get("key") else ""
    fix = f" (fix: {p['fix']})" if p.get("fix") else ""
    return f"{p['severity']}: {key}{p['reason']}{fix}"


def _render(plan: dict[str, Any], *, show_ranks: bool) -> None:
    from ckpt_tool.cli._tables import SEVERITY_STYLES, Column, print_table

    for side in ("source", "target"):
        lay = plan.get(side) or {}
        if lay.get("origins"):
            print_text(f"{side} layout: " + "  ".join(
                f"{k}{lay.get(k) if lay['origins'].get(k) != 'unknown' else '?'} "
                f"({lay['origins'][k]})" for k in ("tp", "pp", "ep")))
    if (plan.get("target") or {}).get("norm_names"):
        print_text(f"legacy norm names: {plan['target']['norm_names']}")
    opt = plan.get("optimizer") or {}
    if opt:
        said = (f"; content metadata says {opt['content_metadata_says']}"
                if opt.get("content_metadata_says") else "")
        print_text(f"optimizer: {opt['description']} "
                   f"({plural(opt['tensors'], 'tensor')}{said}) -> {opt['action']}")

    if plan.get("problems"):
        print_table("feasibility", (Column("severity"), Column("key", name=True),
                                    Column("reason"), Column("fix")),
                    [(p["severity"], p.get("key"), p["reason"], p.get("fix"))
                     for p in plan["problems"]], styles=SEVERITY_STYLES)
    if show_ranks and plan.get("ranks"):
        print_table("plan: what each target rank reads",
                    (Column("rank", "right"), Column("tp", "right"), Column("pp", "right"),
                     Column("ep", "right"), Column("writes", name=True),
                     Column("tensors", "right"), Column("reads", "right"),
                     Column("source files")),
                    [(r["rank"], r["tp"], r["pp"], r["ep"], r["file"], r["tensors"],
                      human_bytes(r["read_bytes"]),
                      ", ".join(sorted({x["file"] or "" for x in r["reads"]})))
                     for r in plan["ranks"]])


def _verdict(result: Any, planning_only: bool) -> str:
    src = result.plan.get("source", {})
    tgt = result.plan.get("target", {})
    unknown = {k for k, v in (src.get("origins") or {}).items() if v == "unknown"}
    layout = (" ".join(f"{k}{'?' if k in unknown else src.get(k)}" for k in ("tp", "pp", "ep"))
              + f" -> tp{tgt.get('tp')} pp{tgt.get('pp')} ep{tgt.get('ep')}")
    errors = [p for p in result.plan.get("problems", []) if p["severity"] == "error"]
    if errors:  # (the lines above it say which: also with --quiet)
        return f"cannot reshard {result.source} ({layout}): {plural(len(errors), 'problem')}"
    if planning_only:
        return f"feasible: {result.source} ({result.source_format}, {layout})"
    return (f"resharded {result.source} ({layout}) -> {result.target} ({result.format}): "
            f"{human_bytes(result.nbytes)} in {result.seconds:.1f} s")
