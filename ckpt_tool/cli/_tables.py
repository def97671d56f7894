"""Tables on stdout that never split a name.

Keys, file names and field paths are what people copy out of a table; a column squeezed to the
terminal's width would cut them mid-word. So:

* stdout not a terminal (a pipe, a file, ``| less``): plain columns aligned with spaces, one line
  per row, as wide as the rows need, no box and no colour;
* a terminal wide enough for every name column whole, every short column whole and, for each
  long-text column, its longest word (at least :data:`_TEXT_MIN` characters): a Rich table
  whose name and short columns never wrap and whose long-text columns wrap between words
  (messages name keys too: those are never cut either);
* a narrower terminal: one record per row, the row's name alone on its first line and the other
  columns, each as ``column: value``, on the indented lines below it.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Sequence

from ckpt_tool.cli._output import stdout

__all__ = ["Column", "print_table", "table_lines", "record_lines", "SEVERITY_STYLES"]

SEVERITY_STYLES = {"error": "red", "warning": "yellow", "note": "cyan"}

_TEXT_MIN = 12  # a long-text column narrower than this reads worse than records do
_SHORT = 20  # a column whose every value fits in this many characters never wraps
_INDENT = "    "


@dataclass(frozen=True)
class Column:
    """One column: its header, ``justify`` (``left``/``right``), and ``name``: True for a column
    of names (keys, files, fields), which is never split whatever its width."""

    header: str
    justify: str = "left"
    name: bool = False


def print_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[Any]], *,
                styles: dict[str, str] | None = None, last_row_style: str | None = None) -> None:
    """Print ``rows`` (plain text cells, no markup) under ``title`` on stdout. ``styles``: a
    Rich style for each cell value that should stand out (e.g. ``{"error": "red"}``), on a
    terminal only; ``last_row_style`` likewise for a totals row."""
    cells = [[("" if c is None else str(c)) for c in row] for row in rows]
    if not sys.stdout.isatty():
        for line in table_lines(title, columns, cells):
            print(line)
        sys.stdout.flush()
        return
    width = stdout.size.width
    if _needed_width(columns, cells) <= width:
        _print_rich(title, columns, cells, styles or {}, last_row_style)
    else:
        for line in record_lines(title, columns, cells, width):
            stdout.print(line, highlight=False, markup=False, soft_wrap=True)


def table_lines(title: str, columns: Sequence[Column], cells: Sequence[Sequence[str]]
                ) -> list[str]:
    """The plain form: the title, the header and one line per row, columns two spaces apart."""
    widths = [max([len(col.header), *(len(r[i]) for r in cells)])
              for i, col in enumerate(columns)]
    out = [title]
    for row in [[col.header for col in columns], *cells]:
        parts = [v.rjust(w) if col.justify == "right" else v.ljust(w)
                 for v, w, col in zip(row, widths, columns)]
        out.append("  ".join(parts).rstrip())
    return out


def record_lines(title: str, columns: Sequence[Column], cells: Sequence[Sequence[str]],
                 width: int) -> list[str]:
    """One record per row: its first non-empty name on a line of its own (never cut), then
    ``column: value`` fields packed into indented lines of at most ``width`` characters."""
    out = [title]
    lead = next((i for i, c in enumerate(columns) if c.name), 0)
    avail = max(width - len(_INDENT), 20)
    for row in cells:
        first = row[lead] or next((v for v, c in zip(row, columns) if c.name and v), "")
        out.append(first)
        fields = [f"{col.header}: {v}" for v, col in zip(row, columns)
                  if v and v != first]
        line = ""
        for f in fields:
            if line and len(line) + 3 + len(f) <= avail:
                line += "   " + f
                continue
            if line:
                out.append(_INDENT + line)
            if len(f) <= avail:
                line = f
            else:  # a long text: wrapped between words, never inside one
                parts = textwrap.wrap(f, avail, break_long_words=False, break_on_hyphens=False)
                out.extend(_INDENT + p for p in parts[:-1])
                line = parts[-1]
        if line:
            out.append(_INDENT + line)
    return out


def _kinds(columns: Sequence[Column], cells: Sequence[Sequence[str]]) -> list[tuple[int, bool]]:
    """Per column: (the width it needs whole, whether it may wrap)."""
    out = []
    for i, col in enumerate(columns):
        longest = max([len(col.header), *(len(r[i]) for r in cells)])
        wraps = not col.name and longest > _SHORT
        if wraps:
            word = max((len(w) for r in cells for w in r[i].split()), default=0)
            out.append((min(longest, max(_TEXT_MIN, word)), True))
        else:
            out.append((longest, False))
    return out


def _needed_width(columns: Sequence[Column], cells: Sequence[Sequence[str]]) -> int:
    # Rich's default box: one border per column plus one, one space of padding each side
    return sum(w for w, _ in _kinds(columns, cells)) + 3 * len(columns) + 1


def _print_rich(title: str, columns: Sequence[Column], cells: Sequence[Sequence[str]],
                styles: dict[str, str], last_row_style: str | None) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for col, (need, wraps) in zip(columns, _kinds(columns, cells)):
        if wraps:
            table.add_column(col.header, justify=col.justify, overflow="fold", min_width=need)
        else:
            table.add_column(col.header, justify=col.justify, no_wrap=True, min_width=need)
    for n, row in enumerate(cells):
        table.add_row(*(Text(v, style=styles.get(v, "")) for v in row),
                      style=last_row_style if n == len(cells) - 1 else None)
    stdout.print(table)
