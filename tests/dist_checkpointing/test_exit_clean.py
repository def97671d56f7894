"""A user script that saves, loads resharded and exits without ``destroy_process_group`` must
end cleanly under torchrun (issue 15 item 5: "terminate called without an active exception",
SIGABRT, in some runs after every rank printed ok).

The suite runs the script a few times (``bench/exit_loop.py --runs 50`` is the long loop whose
figure the README quotes) and fails on any non-zero exit, any rank that did not print ok, and
any "terminate called" in the output. ``bad_exit`` itself is checked on outputs of the kinds a
bad run produces, so this test cannot pass by not recognising an abort.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "dist_checkpointing" / "_workers"))

from exit_loop import bad_exit, run_once  # noqa: E402

RUNS = 3

ABORTED = """ok 1
ok 0
terminate called without an active exception
E1126 09:48:13.196000 25132 torch/distributed/elastic/multiprocessing/api.py:1002] failed
(exitcode: -6) local_rank: 0 (pid: 25141) of binary: python3
"""


@pytest.mark.parametrize("code,out,why", [
    (0, "ok 0\nok 1\n", None),
    (1, ABORTED, "terminate called (SIGABRT at exit)"),
    (0, "ok 0\nok 1\nterminate called without an active exception\n",
     "terminate called (SIGABRT at exit)"),
    (1, "ok 0\nok 1\n", "torchrun exit code 1"),
    (0, "ok 0\n", "1 of 2 ranks printed ok"),
])
def test_bad_exit_recognises_every_bad_run(code, out, why):
    assert bad_exit(code, out, 2) == why


@pytest.mark.parametrize("run", range(RUNS))
def test_save_load_then_plain_exit_is_clean(run, tmp_path):
    why = run_once("ours", 2, tmp_path)
    assert why is None, why
