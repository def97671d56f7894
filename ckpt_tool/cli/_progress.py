"""Rich progress bars on stderr (only when stderr is a terminal): bytes, items, throughput.

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


@contextlib.contextmanager
def progress_bar(description: str, *, enabled: bool = True) -> Iterator[object]:
    """A progress sink for ``ops`` functions; draws on stderr only when it is a terminal (and
    ``enabled``: not ``--quiet``/``--no-progress``)."""
    if not (enabled and sys.stderr.isatty()):
        yield NullProgress()
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(),
                  DownloadColumn(binary_units=True), TransferSpeedColumn(),
                  TextColumn("{task.fields[tensors]}"), TimeRemainingColumn(),
                  console=stderr.console, transient=True) as bar:
        yield _RichProgress(bar, description)
