"""Process-group helpers for code that runs under ``torchrun`` (gloo, CPU).

Gloo's background threads can abort the interpreter at exit ("terminate called without an
active exception") when one rank tears its connections down while a peer is still closing.
``exit_cleanly`` lines the ranks up, destroys the group, runs the Python exit handlers (which
stop multiprocessing managers and helper processes, e.g. Megatron-Core's async-write queue) and
leaves without running C++ static destructors, so a run that finished its work never reports a
signal and leaves no process behind holding its output pipes.

A library user's script exits the ordinary way instead, often without destroying its group:
``register_exit_teardown`` (registered when ``ckpt_tool.dist_checkpointing`` is imported) waits
at exit, before the interpreter finalizes, until gloo's worker threads are idle
(``quiesce_gloo_workers``), which destroys nothing and keeps a late tensor release in a worker
from aborting the process.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Callable


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


GLOO_WORKER = "pt_gloo_runloop"  # the thread name of ProcessGroupGloo's work-queue workers


def gloo_worker_states(task_dir: str = "/proc/self/task") -> list[str] | None:
    """The scheduler state letter (``R``, ``S``, ``D`` ...) of every gloo worker thread of this
    process (``[]``: none), or None where ``/proc`` cannot tell (not Linux)."""
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    states = []
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/comm") as fh:
                if fh.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{task_dir}/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:  # the thread ended meanwhile
            continue
        states.append(stat[stat.rindex(")") + 2:].split(" ", 1)[0])
    return states


def quiesce_gloo_workers(timeout: float = 5.0, interval: float = 0.01, calm_checks: int = 3,
                         states: Callable[[], list[str] | None] = gloo_worker_states) -> bool:
    """Wait until every gloo worker thread sleeps (``calm_checks`` looks in a row, ``interval``
    apart, the GIL released in between); False after ``timeout`` seconds.

    Why: a gloo worker drops its reference to a finished collective's tensors a moment after
    the caller's ``wait()`` returned. When Python had already dropped its own reference (the
    temporary tensors of ``all_gather_object``, ``broadcast_object_list`` ...), that drop
    releases the tensor's Python object and takes the GIL; if the interpreter has started to
    finalize by then, Python ends the thread inside C++ code that may not be unwound and the
    process dies with "terminate called without an active exception" (SIGABRT) after the
    script's work is done (pytorch/pytorch#190489). Run before finalization (an ``atexit`` handler), this lets every
    such drop happen while the interpreter is alive. It never touches a process group."""
    import time

    deadline = time.monotonic() + timeout
    calm = -1  # the first look counts only after the GIL was released once
    while True:
        now = states()
        if not now:  # no gloo workers, or no /proc to ask
            return True
        calm = calm + 1 if all(s == "S" for s in now) else 0
        if calm >= calm_checks:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)  # the GIL is free: a worker waiting for it finishes its drop


_exit_teardown_registered = False


def register_exit_teardown() -> None:
    """Register (once) the ``atexit`` handler that lets gloo workers finish before the
    interpreter finalizes (:func:`quiesce_gloo_workers`); at exit it returns at once where no
    gloo worker thread exists. ``ckpt_tool.dist_checkpointing`` registers it when imported, so it runs
    after the exit handlers registered later (LIFO), i.e. after most of the user's."""
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        _exit_teardown_registered = True
        atexit.register(_exit_teardown)


def _exit_teardown() -> None:
    if "torch.distributed" in sys.modules:  # gloo workers may outlive the default group
        quiesce_gloo_workers()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not change the exit code
            pass
