"""The one output helper: data to stdout (JSON or Rich), messages and progress to stderr.

Rich is imported only when something is rendered with it (a table, a tree, a progress bar):
``--json`` output and one-line messages are plain text, so they start faster and print
brackets in paths and verdicts (``[keys only]``) literally instead of reading them as markup.

On a terminal, text for people is folded to its width between words (never inside one), each
continuation line indented under the line's label (``note: ``, ``backend: ``); a quoted
command (``'ckpt convert --to torch_dist'``) is never split, and what a user copies (the resume
recipe) is laid out to copy whole: one flag per line with ``\\`` continuations, one Python
statement per line. Piped, every line is printed as it is, one line each.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
from typing import Any

__all__ = ["stdout", "stderr", "print_json", "print_text", "message", "error", "human_bytes",
           "quiet_unless_main_rank", "hush", "fold", "terminal_width", "resume_lines",
           "print_resume"]

# Piped output is read by people too (``| less``): don't squeeze tables to 80 columns there.
_PIPE_WIDTH = 200
_quiet = [False]  # messages dropped (a torchrun rank other than 0)
_hushed = [False]  # --quiet: only messages that explain a failure


class _LazyConsole:
    """A ``rich.console.Console`` built on first use (attribute access forwards to it)."""

    def __init__(self, *, to_stderr: bool) -> None:
        self._to_stderr = to_stderr
        self._console: Any = None

    @property
    def console(self) -> Any:
        """The Rich console itself (created now if it does not exist yet)."""
        if self._console is None:
            from rich.console import Console

            if self._to_stderr:
                self._console = Console(stderr=True, soft_wrap=True, quiet=_quiet[0])
            else:
                self._console = Console(soft_wrap=True,
                                        width=None if sys.stdout.isatty() else _PIPE_WIDTH)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)


stdout = _LazyConsole(to_stderr=False)
stderr = _LazyConsole(to_stderr=True)


def print_json(data: Any) -> None:
    """Machine output: one JSON document on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def print_text(text: str) -> None:
    """Plain text on stdout (no markup, no highlighting): on a terminal folded to its width
    (:func:`fold`), so that no name is cut by the terminal's own wrapping; elsewhere as it is."""
    width = terminal_width(sys.stdout)
    sys.stdout.write((text if width is None else fold(text, width)) + "\n")
    sys.stdout.flush()


def message(text: str, *, failure: bool = False, folded: bool = True) -> None:
    """A message for people, on stderr, as plain text (no markup, no highlighting), folded on
    a terminal (unless ``folded`` is False: text laid out already). With ``--quiet`` only a
    ``failure`` (the verdict line of a non-zero exit) is printed."""
    if not _quiet[0] and (failure or not _hushed[0]):
        width = terminal_width(sys.stderr) if folded else None
        sys.stderr.write((text if width is None else fold(text, width)) + "\n")
        sys.stderr.flush()


def print_resume(recipe: Any) -> None:
    """How to resume from what a command wrote (``ops._resume.ResumeRecipe`` or None), last
    on stderr: :func:`resume_lines`."""
    if recipe is not None:
        for line in resume_lines(recipe, terminal_width(sys.stderr)):
            message(line, folded=False)


def error(line: str) -> None:
    """``ckpt: error: LINE`` on stderr (folded on a terminal), whatever ``--quiet`` says."""
    width = terminal_width(sys.stderr)
    text = f"ckpt: error: {line}"
    sys.stderr.write((text if width is None else fold(text, width)) + "\n")
    sys.stderr.flush()


def terminal_width(stream: Any) -> int | None:
    """The columns of the terminal ``stream`` writes to (``COLUMNS`` when set); None when
    ``stream`` is not a terminal (a pipe, a file: nothing is folded there)."""
    try:
        if not stream.isatty():
            return None
    except (AttributeError, ValueError):  # a closed or replaced stream
        return None
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


# a line's label: ``note: ``, ``ckpt: error: ``, ``common keys: ``, ``resume with Megatron-LM: ``
_LABEL = re.compile(r"(?:ckpt: )?[A-Za-z][\w-]*(?: [\w-]+){0,3}: ")
# a command quoted for copying (never split): 'ckpt convert --to torch_dist', '--no-load-rng'
_QUOTED_COMMAND = re.compile(r"'(?:ckpt |--)[^'\n]*'")
_KEEP = "\x00"  # stands for a space that must not become a line break


def fold(text: str, width: int) -> str:
    """``text`` with each line wrapped between words to ``width`` columns, its continuation
    lines indented under the line's label (or two columns in from the line's own indent). A
    word longer than the width stays whole on a line of its own; a quoted command stays on
    one line."""
    out = []
    for line in text.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip(" "))]
        label = _LABEL.match(line, len(lead))
        hang = len(label.group(0)) if label and len(label.group(0)) <= width // 3 else 2
        kept = _QUOTED_COMMAND.sub(lambda m: m.group(0).replace(" ", _KEEP), line)
        parts = textwrap.wrap(kept, width, subsequent_indent=lead + " " * hang,
                              break_long_words=False, break_on_hyphens=False)
        out.extend(p.replace(_KEEP, " ") for p in parts or [""])
    return "\n".join(out)


def resume_lines(recipe: Any, width: int | None) -> list[str]:
    """The lines that say how to resume (an ``ops._resume.ResumeRecipe``). ``width`` None
    (not a terminal): ``recipe.lines()``, one line each. On a terminal: the flags one per
    line with ``\\`` continuations and the ``dist_checkpointing`` calls one statement per
    line, under their heading, so that copying them at any width gives a working command."""
    if width is None:
        return recipe.lines()
    from ckpt_tool.ops._resume import FRAMEWORK_NAMES

    out: list[str] = []
    if recipe.megatron_lm:
        out.append("resume with Megatron-LM (add these flags):")
        out += _continued(_flag_groups(recipe.megatron_lm), width)
    if recipe.framework in FRAMEWORK_NAMES:
        out.append(f"resume with {FRAMEWORK_NAMES[recipe.framework]}:")
        out += _continued([[o] for o in recipe.overrides], width)
    out += [fold(f"  - {n}", width) for n in recipe.notes]
    if recipe.dist_checkpointing:
        out.append("resume with dist_checkpointing (Python):")
        out += ["    " + s for stmt in _statements(recipe.dist_checkpointing)
                for s in _fold_call(stmt, width - 4)]
    return out


def _flag_groups(argv: list[str]) -> list[list[str]]:
    """``--load DIR --no-load-rng`` -> ``[["--load", "DIR"], ["--no-load-rng"]]``."""
    groups: list[list[str]] = []
    for arg in argv:
        if groups and not arg.startswith("-") and len(groups[-1]) == 1 \
                and groups[-1][0].startswith("-"):
            groups[-1].append(arg)
        else:
            groups.append([arg])
    return groups


def _continued(groups: list[list[str]], width: int) -> list[str]:
    """Shell lines, four columns in, each but the last ending in `` \\``; a flag and its value
    too wide together for the terminal go on lines of their own."""
    import shlex

    words = [shlex.join(g) for g in groups]
    words = [w for g, joined in zip(groups, words)
             for w in ([joined] if len(joined) + 6 <= width else map(shlex.quote, g))]
    return ["    " + w + (" \\" if i < len(words) - 1 else "") for i, w in enumerate(words)]


def _statements(code: str) -> list[str]:
    """``a = 1; b = f(a)`` -> ``["a = 1", "b = f(a)"]`` (a ``;`` inside quotes stays)."""
    out, cur, quote = [], "", ""
    for i, ch in enumerate(code):
        if quote:
            quote = "" if ch == quote and code[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";":
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return [s for s in [*out, cur.strip()] if s]


def _fold_call(stmt: str, width: int) -> list[str]:
    """One Python statement in lines of at most ``width`` columns where it can break: after
    an opening parenthesis or brace, or a comma inside them (Python continues the line
    there); continuation lines are indented four more columns."""
    if len(stmt) <= width:
        return [stmt]
    breaks, depth, quote = [], 0, ""
    for i, ch in enumerate(stmt):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "({":
            depth += 1
            breaks.append(i + 1)
        elif ch in ")}":
            depth -= 1
        elif ch == "," and depth:
            breaks.append(i + 1)
    lhs, eq, rhs = stmt.partition(" = ")
    if not breaks and eq:  # ``d = '/a/long/path'``: the value on a line of its own
        return [f"{lhs} = (", f"    {rhs})"]
    lines: list[str] = []
    start, last = 0, 0
    for b in [*breaks, len(stmt)]:
        room = width - (4 if lines else 0)
        if len(stmt[start:b].strip()) > room and last > start:
            lines.append(stmt[start:last].strip())
            start = last
        last = b
    lines.append(stmt[start:].strip())
    return lines[:1] + ["    " + line for line in lines[1:]]
def hush(value: bool = True) -> None:
    """``--quiet``: from now on :func:`message` prints failures only (reset by the root
    command for every run)."""
    _hushed[0] = value


def quiet_unless_main_rank() -> None:
    """Under torchrun only rank 0 prints: other ranks' stdout goes to /dev/null and their
    messages are dropped; their errors go to torchrun's reply file (`_torchrun.record_error`)."""
    import os

    from ckpt_tool.parallel import under_torchrun

    if not under_torchrun() or os.environ.get("RANK", "0") == "0":
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    _quiet[0] = True
    if stderr._console is not None:
        stderr._console.quiet = True


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"
