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


def rank_in_job() -> int:
    """This process's global rank under torchrun (0 without it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def record_error(line: str) -> bool:
    """Hand one error line to the launcher; True when this process prints it itself.

    Under torchrun only rank 0 prints errors. Every rank writes its line to the reply file
    torchrun's agent gives it (``TORCHELASTIC_ERROR_FILE``, JSON as torch's ``record`` writes),
    where ``torchrun`` shows it in its failure report and ``ckpt --nproc N`` reads it back
    when rank 0 printed none. Without torchrun: print it."""
    rank = rank_in_job()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE") if rank or "RANK" in os.environ else None
    if path:
        import json
        import time

        try:
            with open(path, "w") as fh:
                # the layout of torch's own ``record`` (its report shows ``py_callstack``)
                json.dump({"message": {"message": line, "extraInfo": {
                    "py_callstack": line, "timestamp": str(int(time.time()))}}}, fh)
        except OSError:
            return True  # no reply file: say it here rather than not at all
    return rank == 0


def group_initialized() -> bool:
    """A default process group exists (never imports torch: a run without one has not)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def exit_cleanly(code: int = 0) -> None:
    """Flush stdio, barrier (only for exit codes 0 and 1, ok and findings: every rank reached the same
    verdict; an error, 2 or other, may be one rank's alone), destroy the default
    process group (if any), run the exit handlers, flush stdio, ``os._exit(code)``."""
    _flush()  # before the barrier: once a peer exits, the agent may stop this rank at once
    try:
        if group_initialized():
            import torch.distributed as dist

            try:
                if code in (0, 1):
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
        _flush()
        os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not change the exit code
            pass
