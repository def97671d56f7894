"""Rich progress bars on stderr (only when stderr is a terminal): bytes, items, throughput.

The line fits the terminal: the bar takes the room the other columns leave; on a terminal
narrower than 80 columns the rate and the time left are left out. The rate is the bytes per
second so far (nothing before the first bytes arrive), never a placeholder.

A sink has ``start(total_bytes, total_count, unit="tensor")`` and ``update(nbytes,
count_done)``; ``start`` may be called again for a further phase of the same job (``validate
--deep``: the files scanned, then the tensors read), which draws a bar of its own.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from ckpt_tool.cli._output import stderr

__all__ = ["progress_bar", "NullProgress"]


class NullProgress:
    """A progress sink that draws nothing (not a terminal, ``--quiet``, ``--no-progress``)."""

    def start(self, total_bytes: int, total_tensors: int, unit: str = "tensor") -> None:
        pass

    def update(self, nbytes: int, tensors_done: int) -> None:
        pass


class _RichProgress:
    def __init__(self, bar, description: str):
        self._bar = bar
        self._description = description
        self._task = None
        self._total = 0
        self._unit = "tensor"

    def start(self, total_bytes: int, total_tensors: int, unit: str = "tensor") -> None:
        self._total, self._unit = total_tensors, unit
        self._task = self._bar.add_task(self._description, total=total_bytes,
                                        tensors=f"0/{self._of()}")

    def update(self, nbytes: int, tensors_done: int) -> None:
        if self._task is not None:
            self._bar.update(self._task, advance=nbytes,
                             tensors=f"{tensors_done}/{self._of()}")

    def _of(self) -> str:
        from ckpt_tool.errors import plural

        return plural(self._total, self._unit)


_FULL_WIDTH = 80  # narrower: no rate, no time left


def _rate_column() -> object:
    from rich.progress import ProgressColumn
    from rich.text import Text

    from ckpt_tool.cli._output import human_bytes

    class RateColumn(ProgressColumn):
        """Bytes per second so far; empty until bytes have arrived."""

        def render(self, task: object) -> Text:
            speed = task.finished_speed or task.speed  # type: ignore[attr-defined]
            elapsed = task.elapsed or 0  # type: ignore[attr-defined]
            if speed is None and elapsed > 0:
                speed = task.completed / elapsed  # type: ignore[attr-defined]
            return Text(f"{human_bytes(speed)}/s" if speed else "", style="progress.data.speed")

    return RateColumn(table_column=_whole())


def _whole() -> object:
    from rich.table import Column

    return Column(no_wrap=True)


@contextlib.contextmanager
def progress_bar(description: str, *, enabled: bool = True) -> Iterator[object]:
    """A progress sink for ``ops`` functions; draws on stderr only when it is a terminal (and
    ``enabled``: not ``--quiet``/``--no-progress``)."""
    if not (enabled and sys.stderr.isatty()):
        yield NullProgress()
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    columns: list = [TextColumn("{task.description}", table_column=_whole()),
                     BarColumn(bar_width=None),
                     DownloadColumn(binary_units=True, table_column=_whole())]
    full = stderr.console.size.width >= _FULL_WIDTH
    if full:
        columns.append(_rate_column())
    columns.append(TextColumn("{task.fields[tensors]}", table_column=_whole()))
    if full:
        columns.append(TimeRemainingColumn(table_column=_whole()))
    with Progress(*columns, console=stderr.console, transient=True) as bar:
        yield _RichProgress(bar, description)
