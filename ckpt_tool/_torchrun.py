"""Process-group helpers for code that runs under ``torchrun`` (gloo, CPU).

Gloo's background threads can abort the interpreter at exit ("terminate called without an
active exception") when one rank tears its connections down while a peer is still closing.
``exit_cleanly`` lines the ranks up, destroys the group, runs the Python exit handlers (which
stop multiprocessing managers and helper processes, e.g. Megatron-Core's async-write queue) and
leaves without running C++ static destructors, so a run that finished its work never reports a
signal and leaves no process behind holding its output pipes.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_cleanly(code: int = 0) -> None:
    """Barrier, destroy the default process group (if any), flush stdio, ``os._exit(code)``."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
    finally:
        run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
        if run_exit_handlers is not None:
            try:
                run_exit_handlers()
            except Exception:
                pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe must not change the exit code
                pass
        os._exit(code)
