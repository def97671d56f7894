"""``ckpt reshard SRC DST --tp N --pp M [--ep E]``: a checkpoint ready to resume at another layout."""

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ckpt_tool.cli._errors import handle_errors, state
from ckpt_tool.cli._options import (DebugFlag, IterationOption, JsonFlag, NoProgressFlag,
                                    NoVerifyFlag, OverwriteFlag, QuietFlag, SourcePath,
                                    TrustFlag, at_iteration, completer)
from ckpt_tool.cli._output import human_bytes, message, print_json, stdout
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
        help="Legacy targets: name the layer norms as a local-spec model (--transformer-impl "
        "local) holds them (input_layernorm.*, pre_mlp_layernorm.*), or by the fused "
        "Transformer-Engine names (default: from args.transformer_impl).")] = None,
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
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    iteration: IterationOption = None,
    quiet: QuietFlag = False,
    no_progress: NoProgressFlag = False,
    debug: DebugFlag = False,
) -> None:
    """Rewrite a checkpoint for another TP/PP/EP layout (feasibility is checked first: every
    reason the target cannot work is reported with its fix; exit 1 then). Sizes not given keep
    the source's.

    \b
    Examples:
      ckpt reshard checkpoints/gpt/iter_0001000 gpt-tp4 --tp 4
      ckpt reshard checkpoints/gpt --tp 1 --pp 4 --check
    """
    from ckpt_tool.errors import UsageError
    from ckpt_tool.ops.reshard import ReshardRequest
    from ckpt_tool.ops.reshard import reshard as run_reshard

    if vocab_fill not in ("copy", "zero"):
        raise UsageError(f"bad --vocab-fill {vocab_fill!r}", hint="use copy or zero")
    src = at_iteration(src, iteration)
    req = ReshardRequest(tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, first_stage_layers=first_layers,
                         last_stage_layers=last_layers, to=to,
                         rules=tuple(str(r) for r in rules or ()),
                         drop_optimizer=drop_optimizer,
                         make_vocab_size_divisible_by=divisible_by, vocab_size=vocab_size,
                         vocab_fill=vocab_fill, local_spec=local_spec)
    with progress_bar("reshard", enabled=not (check or dry_run or quiet or no_progress)) as bar:
        result = run_reshard(src, dst, req, check=check, dry_run=dry_run, trust=trust,
                             overwrite=overwrite, verify=not no_verify,
                             verify_source=not no_verify, progress=bar,
                             workers=workers)
    state.verdict = 0 if result.ok else 1  # kept if stdout's reader goes away
    if json_:
        print_json(result.to_dict())
    else:
        _render(result.plan, show_ranks=dry_run)
    for note in getattr(result, "notes", None) or ():
        if note.startswith("reclaimed"):  # (the others are in the feasibility table)
            message(f"note: {note}")
    message(_verdict(result, check or dry_run), failure=not result.ok)
    if not result.ok:
        raise typer.Exit(1)


def _render(plan: dict[str, Any], *, show_ranks: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    for side in ("source", "target"):
        lay = plan.get(side) or {}
        if lay.get("origins"):
            stdout.print(f"{side} layout: " + "  ".join(
                f"{k}{lay.get(k) if lay['origins'].get(k) != 'unknown' else '?'} "
                f"({lay['origins'][k]})" for k in ("tp", "pp", "ep")), highlight=False)
    if (plan.get("target") or {}).get("norm_names"):
        stdout.print(escape(f"legacy norm names: {plan['target']['norm_names']}"),
                     highlight=False)
    opt = plan.get("optimizer") or {}
    if opt:
        said = (f"; content metadata says {opt['content_metadata_says']}"
                if opt.get("content_metadata_says") else "")
        stdout.print(escape(f"optimizer: {opt['description']} "
                            f"({plural(opt['tensors'], 'tensor')}{said})"
                            f" -> {opt['action']}"), highlight=False)

    if plan.get("problems"):
        table = Table(title="feasibility", title_justify="left")
        for col in ("severity", "key", "reason", "fix"):
            table.add_column(col, overflow="fold")
        for p in plan["problems"]:
            style = {"error": "red", "warning": "yellow"}.get(p["severity"], "cyan")
            table.add_row(f"[{style}]{p['severity']}[/{style}]", escape(p.get("key") or ""),
                          escape(p["reason"]), escape(p.get("fix") or ""))
        stdout.print(table)
    if show_ranks and plan.get("ranks"):
        table = Table(title="plan: what each target rank reads", title_justify="left")
        for col in ("rank", "tp", "pp", "ep", "writes", "tensors", "reads", "source files"):
            table.add_column(col, overflow="fold")
        for r in plan["ranks"]:
            files = sorted({x["file"] or "" for x in r["reads"]})
            table.add_row(str(r["rank"]), str(r["tp"]), str(r["pp"]), str(r["ep"]),
                          escape(r["file"]), str(r["tensors"]), human_bytes(r["read_bytes"]),
                          escape(", ".join(files)))
        stdout.print(table)


def _verdict(result: Any, planning_only: bool) -> str:
    src = result.plan.get("source", {})
    tgt = result.plan.get("target", {})
    unknown = {k for k, v in (src.get("origins") or {}).items() if v == "unknown"}
    layout = (" ".join(f"{k}{'?' if k in unknown else src.get(k)}" for k in ("tp", "pp", "ep"))
              + f" -> tp{tgt.get('tp')} pp{tgt.get('pp')} ep{tgt.get('ep')}")
    errors = [p for p in result.plan.get("problems", []) if p["severity"] == "error"]
    if errors:
        return (f"cannot reshard {result.source} ({layout}): "
                f"{plural(len(errors), 'problem')}; first: {errors[0]['reason']}")
    if planning_only:
        return f"feasible: {result.source} ({result.source_format}, {layout})"
    return (f"resharded {result.source} ({layout}) -> {result.target} ({result.format}): "
            f"{human_bytes(result.nbytes)} in {result.seconds:.1f} s")
