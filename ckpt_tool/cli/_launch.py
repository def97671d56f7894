"""``ckpt --nproc N COMMAND …``: run one command over N local ranks, as ``torchrun`` would,
and show what the single-process command shows.

The ranks are started by torch's elastic launcher in this process (the agent ``torchrun``
runs, standalone rendezvous on localhost), each running ``python -m ckpt_tool COMMAND …`` with
this process's stdout and stderr (a terminal stays a terminal: progress bars work). What
``torchrun`` adds is left out: its log lines, its ``ChildFailedError`` report, and its exit
status 1 for any failure. The exit code is rank 0's (every rank reaches the same verdict), and
the one error line is rank 0's; where rank 0 printed none (another rank failed first and the
agent stopped rank 0), it is the first failing rank's, read from the reply file that rank
wrote (:func:`ckpt_tool._torchrun.record_error`).

Work too small to gain runs in one process, with a note saying so (:func:`one_process_reason`):
starting the ranks costs seconds whatever the work — the launcher's agent, the rendezvous, and
every rank importing torch for its gloo group (measured on 2 cores: ``--nproc 2`` on a 1 MB
checkpoint 7 s, one process under 1 s; on 497 MB, 2 ranks took twice as long as one process
for every target, README "Writing torch_dist at the speed of its bytes") — while one process
moves 160-330 MB/s of checkpoint on the same machine: below :data:`MIN_BYTES` of input it is
done in about the time the ranks take to start. Commands that read metadata only (``inspect``,
``diff --keys-only``, ``reshard --check``/``--dry-run``) never gain.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Sequence

__all__ = ["run_on_ranks", "outcome", "one_process_reason", "MIN_BYTES", "MIN_BYTES_ENV"]

#: Input below this many bytes runs in one process (see the module docstring); the environment
#: variable :data:`MIN_BYTES_ENV` sets another bound (``0``: always start the ranks, whatever
#: the command).
MIN_BYTES = 1 << 30
MIN_BYTES_ENV = "CKPT_NPROC_MIN_BYTES"
_INPUTS = {"convert": ("src",), "reshard": ("src",), "validate": ("path",), "diff": ("a", "b")}


def one_process_reason(command: str, params: dict, nproc: int) -> str | None:
    """Why ``ckpt --nproc NPROC COMMAND`` (its parsed ``params``) should run in one process, as
    the note to print (``""``: one process, nothing to say: an input that does not exist);
    None: start the ranks."""
    bound = _min_bytes()
    if bound <= 0:
        return None
    if (command not in _INPUTS or params.get("keys_only") or params.get("check")
            or params.get("dry_run")):
        return f"--nproc {nproc} ignored: {command} reads metadata only"
    paths = [params.get(name) for name in _INPUTS[command]]
    if not all(p is not None and os.path.exists(p) for p in paths):
        return ""  # the command's own error says which
    size = sum(_bytes_under(p, bound) for p in paths)
    if size >= bound:
        return None
    from ckpt_tool.cli._output import human_bytes

    return (f"--nproc {nproc} ignored: {human_bytes(size)} of input is less than "
            f"{human_bytes(bound)}, which one process handles faster than {nproc} ranks start "
            f"({MIN_BYTES_ENV}=0 starts them anyway)")


def _min_bytes() -> int:
    text = os.environ.get(MIN_BYTES_ENV)
    try:
        return MIN_BYTES if text is None else int(text)
    except ValueError:
        return MIN_BYTES


def _bytes_under(path: object, limit: int) -> int:
    """The bytes of the files at ``path`` (a file, or a directory walked until ``limit`` is
    reached: a save directory of many iterations costs no more than that)."""
    total, todo = 0, [str(path)]
    while todo and total < limit:
        p = todo.pop()
        try:
            if os.path.isdir(p):
                todo.extend(e.path for e in os.scandir(p))
            else:
                total += os.stat(p).st_size
        except OSError:  # unreadable or gone: the command itself says so
            continue
    return total


def outcome(failures: dict[int, tuple[int, str, float]]) -> tuple[int, str | None]:
    """The exit code and the error line to print (None: rank 0 printed what it had to) for
    the failed ranks ``{rank: (exitcode, message, timestamp)}``; pure.

    Rank 0 exited with a code: that code, and it printed its own line. Otherwise the first
    failure (an exit code before a signal, SIGTERM (the agent's) last, then the earliest, then
    the lowest rank) speaks: its reply-file message, or for a rank ended
    by a signal "rank K was killed by SIGNAME" and 128 + the signal number, as a shell
    reports it."""
    if not failures:
        return 0, None
    if 0 in failures and failures[0][0] > 0:
        return failures[0][0], None
    # the agent stops the other ranks with SIGTERM once one fails: an exit code speaks first
    rank = min(failures, key=lambda k: (failures[k][0] <= 0, failures[k][0] == -signal.SIGTERM,
                                        failures[k][2], k))
    code, message, _ = failures[rank]
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return 128 - code, f"rank {rank} was killed by {name}" + (
            " (out of memory?)" if -code == signal.SIGKILL else "")
    if not message or message.startswith("To enable traceback"):  # torch's placeholder
        if code == 1:  # findings: a verdict, which rank 0 printed before any rank left
            return 1, None
        message = f"rank {rank} failed with exit code {code} (rerun with --debug)"
    return code, message


def run_on_ranks(nproc: int, argv: Sequence[str]) -> tuple[int, str | None]:
    """Run ``ckpt ARGV`` on ``nproc`` local ranks; (exit code, error line to print or None)."""
    import logging
    import uuid

    logging.disable(logging.CRITICAL)  # this process only runs the agent: its logs are noise
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets (without its warning)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", "ckpt_tool", *argv)
    except ChildFailedError as exc:
        return outcome({rank: (f.exitcode, _message(f.message), float(f.timestamp))
                        for rank, f in exc.failures.items()})
    except KeyboardInterrupt:
        return 130, "interrupted"
    except Exception as exc:  # noqa: BLE001 - e.g. a signal stopped the agent
        if type(exc).__name__ == "SignalException":  # it stopped the ranks with that signal
            from ckpt_tool._program import stop_line

            line, code = stop_line(int(getattr(exc, "sigval", signal.SIGINT)))
            return code, line
        raise
    return 0, None


def _message(message: object) -> str:
    """A reply file's message: ours is ``{"message": line, "extraInfo": …}``."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return message if isinstance(message, str) else ""
