"""Run the "save, resharded load, exit" user script many times under torchrun; count bad exits.

    python bench/exit_loop.py [--runs 50] [--lib ours|mcore|none] [--nproc 2]

Each run is ``torchrun --standalone --nproc-per-node 2 tests/dist_checkpointing/_workers/
exit_worker.py`` (2 gloo ranks, CPU) in a fresh directory. A run is *bad* when torchrun exits
non-zero, a rank did not print ``ok``, or the output holds "terminate called" (a SIGABRT at
interpreter exit). Prints one line per bad run (its output tail) and a summary line
``ours: 0 of 50 runs bad``; exits 1 when any run was bad. docs/reliability.md quotes its
figures; ``tests/dist_checkpointing/test_exit_clean.py`` runs the same script a few
times in the suite.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "dist_checkpointing" / "_workers"))

from launch import torchrun_outcome  # noqa: E402


def bad_exit(code: int, out: str, nproc: int) -> str | None:
    """Why one run of ``exit_worker.py`` ended badly, or None when every rank printed ok and
    the job exited 0 without any rank reporting ``terminate called``."""
    oks = {line.split()[1] for line in out.splitlines() if line.startswith("ok ")}
    if "terminate called" in out:
        return "terminate called (SIGABRT at exit)"
    if code != 0:
        return f"torchrun exit code {code}"
    if len(oks) != nproc:
        return f"{len(oks)} of {nproc} ranks printed ok"
    return None


def run_once(lib: str, nproc: int, workdir: Path, timeout: float = 600) -> str | None:
    """One torchrun of the worker in ``workdir``: None, or why it was bad (with its output)."""
    ck = workdir / "ck"
    ck.mkdir()
    code, out, _ = torchrun_outcome("exit_worker.py", nproc, "--lib", lib, "--dir", str(ck),
                                    timeout=timeout, cwd=workdir)
    why = bad_exit(code, out, nproc)
    return None if why is None else f"{why}\n{out[-3000:]}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--lib", choices=("ours", "mcore", "none"), default="ours")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    bad = 0
    start = time.monotonic()
    for i in range(1, a.runs + 1):
        with tempfile.TemporaryDirectory(prefix="ckpt-exit-") as tmp:
            why = run_once(a.lib, a.nproc, Path(tmp))
        if why is not None:
            bad += 1
            print(f"run {i}: BAD: {why}", flush=True)
        else:
            print(f"run {i}: ok", flush=True)
    print(f"{a.lib}: {bad} of {a.runs} runs bad ({time.monotonic() - start:.0f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
