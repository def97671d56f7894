"""``ckpt validate PATH``: completeness and integrity of a checkpoint (the CI job).

Exit codes: 0 valid (warnings allowed), 1 at least one error finding (an incomplete or damaged
checkpoint, an expectation not met), 2 the input cannot be read at all (missing path, unknown
format, unsafe pickle without ``--trust``).
"""

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ckpt_tool.cli._errors import describe, handle_errors, state
from ckpt_tool.cli._options import (CheckpointPath, DebugFlag, IterationOption, JsonFlag,
                                    NoProgressFlag, QuietFlag, SwigluOption, TrustFlag,
                                    at_iteration)
from ckpt_tool.cli._output import message, print_json
from ckpt_tool.errors import plural


@handle_errors
def validate(
    path: CheckpointPath,
    json_: JsonFlag = False,
    trust: TrustFlag = False,
    deep: Annotated[bool, typer.Option(
        "--deep", help="Also read every tensor: report read failures and NaN/Inf counts.")] = False,
    expect_tp: Annotated[Optional[int], typer.Option(
        "--expect-tp", min=1, metavar="N",
        help="Fail unless the checkpoint was saved with this TP size.",
        show_default=False)] = None,
    expect_pp: Annotated[Optional[int], typer.Option(
        "--expect-pp", min=1, metavar="N",
        help="Fail unless the checkpoint was saved with this PP size.",
        show_default=False)] = None,
    expect_keys: Annotated[Optional[Path], typer.Option(
        "--expect-keys", metavar="FILE", help="File with one key per line; fail if any is missing.",
        show_default=False)] = None,
    expect_iteration: Annotated[Optional[int], typer.Option(
        "--expect-iteration", metavar="N", help="Fail unless the checkpoint is at this iteration.",
        show_default=False)] = None,
    write_manifest: Annotated[bool, typer.Option(
        "--write-manifest", help="If the checkpoint is valid, add an integrity manifest "
        "(digest and size of every file) that later runs check.")] = False,
    iteration: IterationOption = None,
    quiet: QuietFlag = False,
    no_progress: NoProgressFlag = False,
    swiglu: SwigluOption = None,
    debug: DebugFlag = False,
) -> None:
    """Check a checkpoint for completeness and integrity (CI job): exit 0 valid, 1 problems found,
    2 unreadable input. Every problem is reported, not only the first.

    \b
    Example:
      ckpt validate fixtures/mcore016_gpt_tp2pp2_fp32 --expect-tp 2 --json
    """

    from ckpt_tool.cli._progress import progress_bar
    from ckpt_tool.ops.validate import ValidateResult, read_expected_keys
    from ckpt_tool.ops.validate import validate as run_validate
    from ckpt_tool.parallel import ranks

    try:
        if iteration is not None:  # (without, a missing tracker file is a finding)
            path = at_iteration(path, iteration)
        keys = None if expect_keys is None else read_expected_keys(expect_keys)
        with progress_bar("validate", enabled=not (quiet or no_progress)) as bar:
            result = run_validate(path, trust=trust, deep=deep, expect_tp=expect_tp,
                                  expect_pp=expect_pp, expect_keys=keys,
                                  expect_iteration=expect_iteration, ranks=ranks(),
                                  progress=bar)
    except Exception as exc:
        line, code = describe(exc)
        if json_ and code == 2:  # CI reads a verdict on stdout also when the input is unreadable
            print_json(ValidateResult.for_unreadable(path, line).to_dict())
        raise
    state.verdict = 0 if result.ok else 1  # kept if stdout's reader goes away
    if json_:
        print_json(result.to_dict())
    else:
        render(result)
    message(verdict(result), failure=not result.ok)
    if not result.ok and not write_manifest:
        raise typer.Exit(1)
    if write_manifest and ranks().is_main:
        from ckpt_tool.ops.manifest_checks import add_manifest

        wrote = add_manifest(Path(path), Path(result.root or path), result.findings)
        message(f"wrote {wrote.manifest} ({plural(wrote.files, 'file')})")


# stats shown in the verdict line: key, noun, words after the number and noun
_CHECKED = (("tensors", "tensor", ""), ("objects", "object", ""), ("files", "file", ""),
            ("zip_items_checked", "zip item", " checked"), ("tensors_read", "tensor", " read"),
            ("manifest_files_hashed", "digest", " checked"),
            ("optimizer_params_checked", "optimizer parameter", " checked against the model"))


def verdict(result: Any) -> str:
    """One line: ``valid``/``INVALID``, the format, what was checked, counts of findings and,
    when invalid, the first error."""
    n_err, n_warn = len(result.errors), len(result.warnings)
    what = result.root or result.path
    fmt = f" ({result.format})" if result.format else ""
    s = result.stats
    checked = ", ".join(plural(s[k], noun) + tail for k, noun, tail in _CHECKED if k in s)
    counts = f"{plural(n_err, 'error')}, {plural(n_warn, 'warning')}"
    head = "valid" if result.ok else "INVALID"
    line = f"{head}: {what}{fmt}: {counts}" + (f" [{checked}]" if checked else "")
    if result.errors:  # the stderr line alone says what is wrong (the table has the rest)
        first = result.errors[0]
        where = ": ".join(x for x in (first.file, first.key) if x)
        line += f"; first error: {where + ': ' if where else ''}{first.message}"
    return " ".join(line.split())


def render(result: Any) -> None:
    """The table of findings (stdout); nothing when there are none."""
    if not result.findings:
        return
    from ckpt_tool.cli._tables import SEVERITY_STYLES, Column, print_table

    print_table(plural(len(result.findings), "finding"),
                (Column("severity"), Column("key", name=True), Column("file", name=True),
                 Column("message")),
                [(f.severity, f.key, f.file, f.message) for f in result.findings],
                styles=SEVERITY_STYLES)
