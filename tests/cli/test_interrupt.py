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


@pytest.mark.parametrize("to", ["torch", "torch_dist", "safetensors"])
def test_ctrl_c_is_interrupted_exit_130_and_leaves_nothing(tmp_path, to):
    seen = set()
    for i, delay in enumerate((0.2, 0.3, 0.45, 0.6, 0.9, 1.2, 1.6, 2.2)):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "convert", str(FIX),
                                 str(out), "--to", to], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:  # finished before the signal
            seen.add("done")
            continue
        seen.add("interrupted")
        assert proc.returncode == 130, (delay, err[-800:])
        assert "interrupted" in err and "internal error" not in err and "Traceback" not in err
        assert not out.exists()
        assert [n for n in os.listdir(tmp_path) if n.startswith(f".out{i}.")] == []
    assert "interrupted" in seen
