"""Named moments of a write at which a test can hold the process, so that a fault test kills
(or signals) it at a known moment instead of after a guessed delay, which a busy machine
turns into another moment.

Off unless the environment names points: ``CKPT_PAUSE_AT=staging,between-renames`` (``*``:
every point) and ``CKPT_PAUSE_DIR=DIR``. The first time the process passes a named point it
creates ``DIR/<point>.<pid>`` and waits until ``DIR/<point>.<pid>.go`` exists, or until the
ckpt program's handler has taken a stop signal (then it goes on by itself, and the signal
takes effect, at once or where it was deferred to). The test waits for the first file, then
kills the process, or signals it (and creates the second where the signal is to be ignored).
Cost when off: one environment lookup per point.

The points (where they are passed):

* ``staging`` - an output's staging directory exists, nothing written in it (``ops._output_staging``);
* ``writing`` - a writer reported its first bytes written (``parallel.JobProgress``);
* ``deferred`` - about to call into torch's C++ writer, where a stop signal waits for the
  call's end (``formats.write_guard.uninterrupted``);
* ``fsynced`` - the output is complete and fsynced, before it is put in place;
* ``between-renames`` - replacing an existing output where no atomic exchange is possible:
  the old output is parked beside the target, the new one not yet in place;
* ``renamed`` - the output is in place, its staging not yet removed;
* ``save-file-written`` - the library's save wrote and fsynced one data file
  (``dist_checkpointing``);
* ``save-finalize`` - the library's save wrote every data file, before ``metadata.json``.
"""

from __future__ import annotations

import os
import time

__all__ = ["pause_point", "POINTS"]

POINTS = ("staging", "writing", "deferred", "fsynced", "between-renames", "renamed", "save-file-written",
          "save-finalize")
_passed: set[str] = set()


def pause_point(name: str) -> None:
    """Hold here if the environment asks for ``name`` (see the module doc); else nothing."""
    wanted = os.environ.get("CKPT_PAUSE_AT")
    if not wanted or name in _passed:
        return
    names = wanted.split(",")
    if name not in names and "*" not in names:
        return
    _passed.add(name)
    where = os.environ.get("CKPT_PAUSE_DIR") or "."
    mark = os.path.join(where, f"{name}.{os.getpid()}")
    with open(mark + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(mark + ".tmp", mark)  # the test sees it whole
    from ckpt_tool._program import stop_taken

    while not os.path.exists(mark + ".go") and not stop_taken():
        time.sleep(0.005)
