"""Ctrl-C at any moment of a conversion: one line "interrupted", exit 130, nothing left behind
(also when the interrupt lands inside torch's C++ archive writer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2dp2_fp16opt"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="watches the process in /proc")
@pytest.mark.parametrize("to", ["torch", "torch_dist", "safetensors"])
def test_ctrl_c_is_interrupted_exit_130_and_leaves_nothing(tmp_path, to):
    seen = set()
    for i, delay in enumerate((0.0, 0.1, 0.25, 0.4, 0.6, 0.9, 1.3, 2.0)):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(FIX),
                                 str(out), "--to", to], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        _wait_for_numpy(proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:  # finished before the signal
            seen.add("done")
            continue
        seen.add("interrupted")
        assert proc.returncode == 130, (delay, err[-6000:])
        assert "interrupted" in err and "internal error" not in err and "Traceback" not in err
        assert not out.exists()
        assert [n for n in os.listdir(tmp_path) if n.startswith(f".out{i}.")] == []
    assert "interrupted" in seen


def _wait_for_numpy(proc: subprocess.Popen) -> None:
    """Until the command loads numpy (ckpt's own handler is in place before): delays
    counted from the process start would land in the interpreter's own start-up on a loaded
    machine, where Python's default handler answers, not ckpt."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                if "_multiarray_umath" in maps.read():
                    return
        except OSError:
            return
        time.sleep(0.005)


_SIGNAL_AT = r"""
import os, runpy, signal, sys
import ckpt_tool.ops._staging as staging

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
