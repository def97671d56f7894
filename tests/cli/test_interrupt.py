"""Ctrl-C (SIGINT) and SIGTERM at each moment of a conversion: one line ("interrupted", exit
130; "terminated", exit 143), nothing left behind (also when the signal lands inside torch's
C++ archive writer); once the output is in place, the command reports success.

The signal is sent while the command holds at a named point (``ckpt_tool._pause_points``):
the test waits for that event, so a busy machine changes nothing but the wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2dp2_fp16opt"
EXPECT = {signal.SIGINT: ("interrupted", 130), signal.SIGTERM: ("terminated", 143)}


def _signalled_at(tmp_path: Path, point: str, sig: int, to: str) -> tuple[int, str, Path]:
    """Run ``convert --to TO`` held at ``point``, send ``sig`` there; (exit code, stderr,
    target). Held points before the rename go on by themselves once the handler took the
    signal; after the rename the signal is ignored, and the test lets it go on."""
    out = tmp_path / f"out-{point}"
    pause = tmp_path / f"pause-{point}"
    pause.mkdir()
    env = dict(os.environ, CKPT_PAUSE_AT=point, CKPT_PAUSE_DIR=str(pause))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(FIX), str(out),
                             "--to", to], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    mark = pause / f"{point}.{proc.pid}"
    deadline = time.monotonic() + 900  # a hang guard only: nothing is timed
    while not mark.exists():
        assert proc.poll() is None, f"ended before {point}: {proc.stderr.read()[-3000:]}"
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"never reached {point}")
        time.sleep(0.01)
    proc.send_signal(sig)
    if point == "renamed":
        (pause / f"{point}.{proc.pid}.go").touch()
    _out, err = proc.communicate(timeout=600)
    return proc.returncode, err, out


@pytest.mark.parametrize("to, sig", [("torch", signal.SIGINT), ("torch_dist", signal.SIGINT),
                                     ("safetensors", signal.SIGINT),
                                     ("torch", signal.SIGTERM)])
def test_a_stop_signal_at_each_moment_cleans_up(tmp_path, to, sig):
    line, code = EXPECT[sig]
    for point in ("staging", "writing", "fsynced", "renamed"):
        rc, err, out = _signalled_at(tmp_path, point, sig, to)
        left = [n for n in os.listdir(tmp_path) if n.startswith(f".{out.name}.")]
        assert "Traceback" not in err and "internal error" not in err, err[-3000:]
        assert left == [], (point, left)  # no staging, no lock file
        if point == "renamed":  # the output was in place: success, whatever came after
            assert rc == 0 and out.exists(), (point, err[-3000:])
        else:
            assert rc == code and err.strip().splitlines()[-1] == f"ckpt: error: {line}", \
                (point, rc, err[-3000:])
            assert not out.exists(), point


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_inside_torchs_writer_waits_for_the_call(tmp_path, sig):
    """Held just inside the deferral around a call into torch's C++ writer (``torch.save`` of a
    legacy rank file): the signal takes effect when the call returns, never inside it (an
    exception raised there would abort the process)."""
    line, code = EXPECT[sig]
    rc, err, out = _signalled_at(tmp_path, "deferred", sig, "legacy")
    assert rc == code and err.strip().splitlines()[-1] == f"ckpt: error: {line}", err[-3000:]
    assert "Traceback" not in err and "terminate called" not in err
    assert not out.exists() and os.listdir(tmp_path) == ["pause-deferred"]


_SIGNAL_AT = r"""
import os, runpy, signal, sys
import ckpt_tool.ops._output_staging as staging

where = sys.argv.pop(1)
original = {"fsync": staging.fsync_tree, "commit": staging._put_in_place}[where]

def with_ctrl_c(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
    result = original(*args, **kwargs)
    if where == "commit":
        os.kill(os.getpid(), signal.SIGINT)  # once more, after the output is in place
    return result

setattr(staging, {"fsync": "fsync_tree", "commit": "_put_in_place"}[where], with_ctrl_c)
sys.argv[0] = "ckpt"
runpy.run_module("ckpt_tool", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("where", ["fsync", "commit"])
def test_ctrl_c_around_the_rename_never_leaves_a_complete_output_behind_a_failure(tmp_path, where):
    """Before the rename an interrupt removes everything (exit 130); from the rename on, the
    output is complete and the command reports success (exit 0), never 130 with the output
    in place."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_AT, where, "convert", str(FIX), str(out),
                           "--to", "safetensors"], capture_output=True, text=True, timeout=300)
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".out.")]
    if where == "fsync":
        assert proc.returncode == 130, proc.stderr[-3000:]
        assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists() and leftovers == []
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert out.exists() and leftovers == []
        check = subprocess.run([sys.executable, "-m", "ckpt_tool", "validate", str(out)],
                               capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stderr


# -- under torchrun ---------------------------------------------------------------------------

def _held_job(tmp_path: Path, argv: list[str]) -> tuple[subprocess.Popen, Path, Path]:
    """Start a 2-rank ``convert`` (launched by ``argv``) and wait until both ranks hold at
    ``writing``; (the launcher, the pause directory, the target)."""
    out = tmp_path / "out"
    pause = tmp_path / "pause"
    pause.mkdir()
    env = dict(os.environ, CKPT_PAUSE_AT="writing", CKPT_PAUSE_DIR=str(pause),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CKPT_NPROC_MIN_BYTES="0")  # ranks even for this small a job
    proc = subprocess.Popen([*argv, "convert", str(FIX), str(out), "--to", "torch_dist"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 900  # a hang guard only: nothing is timed
    while len([n for n in os.listdir(pause) if n.startswith("writing.")]) < 2:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"the ranks never reached writing: {os.listdir(pause)}")
        time.sleep(0.01)
    return proc, pause, out


def _nothing_left(tmp_path: Path) -> list[str]:
    return [n for n in os.listdir(tmp_path) if n.startswith(".out.") or n == "out"]


@pytest.mark.multiproc
def test_sigterm_to_the_nproc_launcher_cleans_up_like_ctrl_c(tmp_path):
    proc, _pause, _out = _held_job(tmp_path, [sys.executable, "-m", "ckpt_tool", "--nproc",
                                              "2"])
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.strip()] == ["ckpt: error: terminated"], err
    assert _nothing_left(tmp_path) == []


@pytest.mark.multiproc
@pytest.mark.parametrize("victim", ["torchrun", "rank 0", "rank 1"])
def test_sigterm_under_torchrun_cleans_up(tmp_path, victim):
    """SIGTERM to torchrun (it passes it on to every rank) or to one rank (torchrun then stops
    the other): the ranks end, rank 0 removes its staging directory and lock, nothing hangs."""
    proc, pause, _out = _held_job(tmp_path, [sys.executable, "-m", "torch.distributed.run",
                                             "--standalone", "--nproc-per-node=2", "-m",
                                             "ckpt_tool"])
    ranks = sorted(int(n.split(".")[1]) for n in os.listdir(pause) if n.count(".") == 1)
    if victim == "torchrun":
        os.kill(proc.pid, signal.SIGTERM)
    else:  # which pid is which rank: each rank's environment says
        rank = int(victim.split()[1])
        pid = next(p for p in ranks if f"RANK={rank}".encode() in
                   Path(f"/proc/{p}/environ").read_bytes().split(b"\0"))
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "internal error" not in err, err[-3000:]
    assert _nothing_left(tmp_path) == [], err[-3000:]
