"""``ckpt diff A B``: compare two checkpoints of any formats.

Exit codes: 0 identical (within ``--atol``/``--rtol``), 1 different, 2 an input cannot be read.
"""

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ckpt_tool.cli._errors import handle_errors, state
from ckpt_tool.cli._options import (DebugFlag, IterationOption, JsonFlag, NoProgressFlag,
                                    PlotOption, QuietFlag, SwigluOption, TrustFlag, at_iteration)
from ckpt_tool.cli._output import message, print_json, print_text
from ckpt_tool.errors import plural

# Rows per section of the table (the JSON document always has every difference).
_ROWS = 200

_WHERE = "Checkpoint directory, an iter_* directory, a training save directory or a file"
# CheckpointPath with the names the help and the report use for the two sides.
CheckpointA = Annotated[Path, typer.Argument(metavar="A", help=_WHERE + " (the old side).",
                                             show_default=False, readable=False)]
CheckpointB = Annotated[Path, typer.Argument(metavar="B", help=_WHERE + " (the new side).",
                                             show_default=False, readable=False)]


@handle_errors
def diff(
    a: CheckpointA,
    b: CheckpointB,
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    rename: Annotated[Optional[List[str]], typer.Option(
        "--rename", metavar="OLD=NEW", show_default=False,
        help="Key prefix OLD of A is called NEW in B (repeatable; first match wins).")] = None,
    filter_: Annotated[Optional[str], typer.Option(
        "--filter", metavar="REGEX", show_default=False,
        help="Only keys (B's names) matching this Python regex; skips the common state.")] = None,
    keys_only: Annotated[bool, typer.Option(
        "--keys-only", help="Compare metadata only (keys, dtypes, shapes, the summary of "
        "the common state): no tensor data is read.")] = False,
    atol: Annotated[float, typer.Option(
        "--atol", min=0.0, metavar="X",
        help="Absolute tolerance: equal when |a-b| <= atol + rtol*|b|.")] = 0.0,
    rtol: Annotated[float, typer.Option(
        "--rtol", min=0.0, metavar="X",
        help="Relative tolerance (see --atol). With a tolerance, a dtype "
        "change alone is not a difference: the values decide.")] = 0.0,
    resharded: Annotated[bool, typer.Option(
        "--resharded", help="B is a reshard of A (or A of B): compare every weight and "
        "optimizer value across layouts (TP/PP/EP, legacy or dist, optimizer buckets or model "
        "space, the padded vocabulary on the rows both hold); what a reshard changes by design "
        "(parallel sizes in args, dropped RNG states) is a note, not a difference.")] = False,
    plot: PlotOption = None,
    iteration: IterationOption = None,
    quiet: QuietFlag = False,
    no_progress: NoProgressFlag = False,
    swiglu: SwigluOption = None,
    debug: DebugFlag = False,
) -> None:
    """Compare two checkpoints of any formats: keys on one side only, dtype/shape changes, every
    differing tensor (count, max abs/rel diff, first differing index) and common-state fields.
    Values are exact by default; NaN equals NaN at the same position. A Megatron checkpoint
    and a Hugging Face model directory are compared in HF names (the rules of convert --to
    hf), with each tensor's cosine similarity and largest errors, and the first tensor that
    disagrees (cosine below 0.99). Exit 0 identical, 1 different, 2 unreadable input.

    \b
    Examples:
      ckpt diff fixtures/mcore016_gpt_tp2pp2_fp32 gpt-st --json
      ckpt diff gpt-st gpt-tp4 --filter 'decoder\\.' --rtol 1e-2
      ckpt diff fixtures/mcore016_llama_tp2pp2_distopt llama-hf \\
          --plot similarity.png
      ckpt diff fixtures/mcore016_gpt_tp2pp2_fp32 gpt-tp4 --resharded
    """
    from ckpt_tool.cli._progress import progress_bar
    from ckpt_tool.ops.diff import diff as run_diff
    from ckpt_tool.formats.save_dir import iteration_dirs
    from ckpt_tool.ops.diff import parse_rename

    # --iteration applies to each side that is a training save directory
    a = at_iteration(a, iteration if iteration_dirs(a) else None)
    b = at_iteration(b, iteration if iteration_dirs(b) else None)
    pairs = parse_rename(rename or [])
    if plot is not None:
        from ckpt_tool.ops.diff import check_plotting

        check_plotting()  # before any reading
        if keys_only:
            from ckpt_tool.errors import UsageError

            raise UsageError("--plot draws values; --keys-only reads none")
    with progress_bar("diff", enabled=not (keys_only or quiet or no_progress)) as bar:
        result = run_diff(a, b, rename=pairs, filter=filter_, keys_only=keys_only, atol=atol,
                          rtol=rtol, trust=trust, progress=bar, resharded=resharded,
                          similarity=plot is not None)
    if plot is not None:
        from ckpt_tool.ops.diff import plot_similarity as draw

        draw(result.similarity, plot, f"{result.a} vs {result.b}")
        message(f"plot: {plot}")
    state.verdict = 0 if result.identical else 1  # kept if stdout's reader goes away
    if json_:
        print_json(result.to_dict())
    else:
        render(result)
    message(verdict(result), failure=not result.identical)
    if not result.identical:
        raise typer.Exit(1)


def verdict(result: Any) -> str:
    """One line: ``identical``/``DIFFERENT``, both inputs and formats, the counts."""
    s = result.stats
    counts = [  # (number, noun, words after them): "1 tensor with different values"
        (len(result.only_in_a), "", "only in A"), (len(result.only_in_b), "", "only in B"),
        (len(result.dtype_changes), "dtype change", ""),
        (len(result.shape_changes), "shape change", ""),
        (len(result.values), "tensor", "with different values"),
        (len(result.common_differences), "common-state difference", ""),
        (len(result.objects_only_in_a), "object", "only in A"),
        (len(result.objects_only_in_b), "object", "only in B"),
        (len(result.object_differences), "object-payload difference", ""),
    ]
    what = ", ".join(" ".join(x for x in (plural(n, noun) if noun else str(n), tail) if x)
                     for n, noun, tail in counts if n) or "no differences"
    tol = f", atol={result.atol:g} rtol={result.rtol:g}" if result.atol or result.rtol else ""
    checked = ("keys only" if result.keys_only else
               f"{s.get('tensors_compared', 0)} of "
               f"{plural(s.get('tensors_common', 0), 'common tensor')} compared")
    head = "identical" if result.identical else "DIFFERENT"
    line = (f"{head}: {result.a} ({result.format_a}) vs {result.b} ({result.format_b}): {what} "
            f"[{checked}{tol}]")
    if result.values:
        v = result.values[0]
        line += (f"; first: {v.key}{list(v.first_index)} is {_num(v.first_a)} in A, "
                 f"{_num(v.first_b)} in B" + result.named(v.key)[len(v.key):])
    worst = result.first_disagreeing
    if worst is not None:
        line += (f"; first that disagrees: {result.named(worst.key)} (cosine "
                 f"{worst.cosine:.4g})")
    from ckpt_tool.ops.diff import RESHARDED_HINT

    if not result.identical and RESHARDED_HINT in result.notes:
        line += f" ({RESHARDED_HINT})"
    return line


def _table(title: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    if not rows:
        return
    from ckpt_tool.cli._tables import Column, print_table

    more = len(rows) - _ROWS
    print_table(f"{title} ({len(rows)})",
                [Column(c, name=i == 0) for i, c in enumerate(columns)], rows[:_ROWS])
    if more > 0:
        print_text(f"... {more} more (--json lists all)")


def _num(x: Any) -> str:
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def render(result: Any) -> None:
    """Rich tables of the differences on stdout; notes last."""
    d = result.to_dict()
    name = result.named  # an HF tensor with the Megatron tensor it was mapped from
    _table("only in A", ("key",), [(name(k),) for k in d["only_in_a"]])
    _table("only in B", ("key",), [(name(k),) for k in d["only_in_b"]])
    _table("dtype changes", ("key", "A", "B"), [(name(c["key"]), c["a"], c["b"])
                                                for c in d["dtype_changes"]])
    _table("shape changes", ("key", "A", "B"), [(name(c["key"]), c["a"], c["b"])
                                                for c in d["shape_changes"]])
    _table("different values",
           ("key", "differing", "max abs diff", "max rel diff", "first index", "A", "B"),
           [(name(v["key"]), f"{v['differing']} of {v['numel']}", _num(v["max_abs_diff"]),
             _num(v["max_rel_diff"]), v["first_index"], _num(v["first_a"]), _num(v["first_b"]))
            for v in d["values"]])
    _table("similarity", ("key", "cosine", "max abs error", "max rel error"),
           [(name(x["key"]), _num(x["cosine"]), _num(x["max_abs_error"]),
             _num(x["max_rel_error"])) for x in d.get("similarity", ())])
    _table("common state", ("field", "kind", "A", "B"),
           [(c["path"], c["kind"], c["a"], c["b"]) for c in d["common"]])
    _table("objects only in A", ("unique key",), [(k,) for k in d["objects_only_in_a"]])
    _table("objects only in B", ("unique key",), [(k,) for k in d["objects_only_in_b"]])
    _table("object payloads", ("object.field", "kind", "A", "B"),
           [(c["path"], c["kind"], c["a"], c["b"]) for c in d["objects"]])
    from ckpt_tool.ops.diff import RESHARDED_HINT

    for note in d["notes"]:
        if note != RESHARDED_HINT:  # (in the verdict line)
            message(f"note: {note}")
