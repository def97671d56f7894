"""``ckpt --nproc N``: a command on N ranks shows what one process shows (exit code, one error
line, stdout), and plain ``torchrun`` runs print one error line (rank 0's)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.cli._launch import MIN_BYTES, MIN_BYTES_ENV, one_process_reason, outcome

REPO = Path(__file__).resolve().parents[2]
FP32 = REPO / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"
MISSING_LINE = "ckpt: error: {}: no such file or directory (check the path)"


def _env(**extra: str) -> dict[str, str]:
    """The ranks start whatever the work (the fixtures are far below the size where
    ``--nproc`` runs in one process)."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", MIN_BYTES_ENV: "0", **extra}


def _ckpt(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], env=_env(**env),
                          capture_output=True, text=True, timeout=600, cwd=REPO)


# -- the exit code and the line, from what the agent reports (pure) -------------------------

def test_rank0s_code_wins_and_rank0_printed_its_own_line():
    assert outcome({}) == (0, None)
    assert outcome({0: (2, "x: no such file", 5.0), 1: (2, "x: no such file", 4.0)}) == (2, None)
    assert outcome({0: (1, "", 5.0), 1: (1, "", 5.0)}) == (1, None)


def test_rank0_stopped_by_the_agent_the_failing_ranks_line_is_printed():
    got = outcome({0: (-signal.SIGTERM, "Signal 15 (SIGTERM) received", 7.0),
                   1: (2, "/x: no such file or directory (check the path)", 7.0)})
    assert got == (2, "/x: no such file or directory (check the path)")
    got = outcome({0: (-signal.SIGTERM, "", 7.0), 1: (3, "To enable traceback see: …", 7.0)})
    assert got == (3, "rank 1 failed with exit code 3 (rerun with --debug)")


def test_a_rank_killed_by_a_signal_reads_as_a_shell_would():
    code, line = outcome({0: (-signal.SIGTERM, "", 9.0), 1: (-signal.SIGKILL, "", 8.0)})
    assert code == 128 + signal.SIGKILL and line == "rank 1 was killed by SIGKILL (out of memory?)"


# -- the launcher, end to end ----------------------------------------------------------------

@pytest.mark.multiproc
def test_nproc_missing_path_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "nope"
    proc = _ckpt("--nproc", "2", "inspect", str(missing))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [MISSING_LINE.format(missing)]
    assert proc.stdout == ""


@pytest.mark.multiproc
def test_nproc_diff_prints_the_single_process_report_and_verdict():
    one = _ckpt("diff", str(FP32), str(OPTIM), "--keys-only", "--json")
    two = _ckpt("--nproc", "2", "diff", str(FP32), str(OPTIM), "--keys-only", "--json")
    assert one.returncode == two.returncode == 1, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)  # one document: rank 0 alone prints
    a["stats"].pop("seconds", None), b["stats"].pop("seconds", None)
    assert a == b
    assert two.stderr.splitlines() == one.stderr.splitlines()
    assert "ChildFailedError" not in two.stderr and "torch.distributed" not in two.stderr


@pytest.mark.multiproc
def test_nproc_usage_errors_are_one_line():
    for args, text in ((["--nproc", "2"], "--nproc needs a command"),
                       (["--nproc", "0", "inspect", str(FP32)], "--nproc")):
        proc = _ckpt(*args)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("ckpt: error: ") and text in proc.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("form", ["module", "no-python"])
def test_plain_torchrun_one_error_line_never_tagged_by_rank(tmp_path, form):
    """``torchrun`` itself exits 1 and prints its own report on any failure (that is the
    launcher's, not ours): the ranks print at most one line, rank 0's; rank 1's line is in
    torchrun's report (its reply file)."""
    missing = tmp_path / "nope"
    ckpt_bin = shutil.which("ckpt")
    if form == "no-python" and ckpt_bin is None:
        pytest.skip("no ckpt console script on PATH")
    target = ["-m", "ckpt_tool"] if form == "module" else ["--no-python", ckpt_bin]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", *target, "inspect", str(missing)],
                          env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 1  # torchrun's code for "a worker failed"
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith(("ckpt:", "ckpt["))]
    assert len(ours) <= 1 and "rank 1]" not in proc.stderr, proc.stderr
    assert f"{missing}: no such file or directory" in proc.stderr


def test_findings_stopped_rank0_after_it_printed_add_no_error_line():
    assert outcome({0: (-signal.SIGTERM, "", 3.0), 1: (1, "To enable traceback see: …", 3.0)}) \
        == (1, None)


# -- work too small to gain runs in one process ----------------------------------------------

def test_small_or_metadata_only_work_runs_in_one_process(tmp_path, monkeypatch):
    monkeypatch.delenv(MIN_BYTES_ENV, raising=False)
    assert MIN_BYTES == 1 << 30
    assert "inspect reads metadata only" in one_process_reason("inspect", {"path": FP32}, 2)
    assert "metadata only" in one_process_reason("diff", {"a": FP32, "b": OPTIM,
                                                          "keys_only": True}, 2)
    assert "metadata only" in one_process_reason("reshard", {"src": FP32, "check": True}, 2)
    note = one_process_reason("convert", {"src": FP32}, 4)
    assert note.startswith("--nproc 4 ignored: 1005.7 KiB of input is less than 1.0 GiB")
    assert one_process_reason("validate", {"path": tmp_path / "nope"}, 2) == ""
    big = tmp_path / "big"
    big.mkdir()
    (big / "a.distcp").write_bytes(b"x" * 3000)
    monkeypatch.setenv(MIN_BYTES_ENV, "2000")  # above the bound: the ranks start
    assert one_process_reason("validate", {"path": big}, 2) is None
    assert one_process_reason("diff", {"a": big, "b": FP32}, 2) is None
    monkeypatch.setenv(MIN_BYTES_ENV, "0")  # 0: always
    assert one_process_reason("inspect", {"path": FP32}, 2) is None


def test_nproc_on_a_small_checkpoint_says_it_runs_in_one_process():
    one = _ckpt("validate", str(FP32), "--json")
    two = _ckpt("--nproc", "2", "validate", str(FP32), "--json", **{MIN_BYTES_ENV: str(MIN_BYTES)})
    assert one.returncode == two.returncode == 0, two.stderr
    assert json.loads(one.stdout)["counts"] == json.loads(two.stdout)["counts"]
    assert two.stderr.startswith("ckpt: note: --nproc 2 ignored: "), two.stderr
    two = _ckpt("--nproc", "2", "validate", str(FP32), **{MIN_BYTES_ENV: str(MIN_BYTES)})
    assert two.stderr.splitlines()[0].startswith("ckpt: note: --nproc 2 ignored: ")
    assert two.stderr.splitlines()[1].startswith("valid: ")
    bad = _ckpt("--nproc", "2", "validate", str(FP32), "--frob",
                **{MIN_BYTES_ENV: str(MIN_BYTES)})  # a usage error: one line, at once
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "ckpt: error: no such option: --frob (try 'ckpt validate --help')"]
