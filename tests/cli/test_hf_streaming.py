"""``convert`` to and from HF directories streams: peak memory stays near the largest piece
(measured as the peak RSS of the command, ``os.wait4``, like the bad-input corpus does),
the progress bar draws on a terminal, and a killed ``--to hf`` leaves only its staging
directory.

The model is a random Llama of ~270 MB in fp32 (24 layers; its largest tensor ~3 MB, the
largest stacked piece written ~6 MB). Each direction's peak RSS is compared with the same
command on a tiny model (which has the same imports): holding the model would add ~270 MB,
streaming adds a few pieces. The runs skip the verification pass (``--no-verify``): it maps
the written files in runs of up to 256 MB (page cache, counted in RSS), a bound of ``validate``
tested with it.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

sys.path.insert(0, str(Path(__file__).parent))
from _hf_dirs import llama_dir  # noqa: E402
from _terminal import drain_terminal  # noqa: E402

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
BAR = "━"  # Rich's bar
BIG = dict(hidden=512, inter=1408, layers=24, heads=8, kv=2, vocab=1000, shards=4)
TINY = dict(hidden=64, inter=128, layers=2, heads=8, kv=2, vocab=1000)


def _run(*args, terminal: bool) -> tuple[int, str, int]:
    """``python -m ckpt_tool ARGS`` (stderr on a pseudo-terminal when ``terminal``): the exit
    code, what stderr received and the peak RSS in KiB."""
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(REPO)}
    env.pop("COLUMNS", None)
    master = slave = None
    if terminal:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", *map(str, args)], cwd=REPO,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave if terminal else subprocess.PIPE)
    if terminal:
        os.close(slave)
        got = drain_terminal(master)
    else:
        got = proc.stderr.read()
        proc.stderr.close()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, got.decode(errors="replace"), usage.ru_maxrss


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"big": llama_dir(root / "big", **BIG), "tiny": llama_dir(root / "tiny", **TINY)}


def test_both_directions_stream_with_a_progress_bar(models, tmp_path):
    total = sum(p.stat().st_size for p in models["big"].glob("*.safetensors"))
    assert total > 250 << 20
    peaks = {}
    for size in ("tiny", "big"):  # HF -> torch_dist, then torch_dist -> HF
        mc, hf = tmp_path / f"{size}-mc", tmp_path / f"{size}-hf"
        big = size == "big"
        for argv in (["convert", models[size], mc, "--to", "torch_dist", "--pp", "2"],
                     ["convert", mc, hf, "--to", "hf", "--max-shard-size", "100MB"]):
            code, err, rss = _run(*argv, "--no-verify", *([] if big else ["--no-progress"]),
                                  terminal=big)
            assert code == 0, err
            if big:  # the bar, then the one-line summary
                assert BAR in err and "convert" in err and "converted" in err, err
            peaks[size, argv[4]] = rss << 10
    assert len(list((tmp_path / "big-hf").glob("model-*-of-00003.safetensors"))) == 3
    for to in ("torch_dist", "hf"):
        extra = peaks["big", to] - peaks["tiny", to]
        assert extra < total // 2, (f"--to {to}: peak RSS {peaks['big', to] >> 20} MiB, "
                                    f"{extra >> 20} MiB above a tiny model's, for "
                                    f"{total >> 20} MiB of weights")
    print({k: v >> 20 for k, v in peaks.items()}, "MiB peak RSS")
    result = runner.invoke(app, ["diff", str(models["big"]), str(tmp_path / "big-hf"),
                                 "--keys-only", "--filter", "."])  # the configs differ
    assert result.exit_code == 0, result.output


KILLER = """
import os, signal, sys
from ckpt_tool.ops import _hf_source
real = _hf_source.HfSource.read
def read(self, *a, **k):
    if self.tensors_done == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
_hf_source.HfSource.read = read
from ckpt_tool.cli.app import app
sys.argv = ["ckpt", "convert", sys.argv[1], sys.argv[2], "--to", "hf", "--no-progress",
            "--max-shard-size", "1KB"]
app()
"""


def test_a_killed_export_leaves_only_its_staging_directory(models, tmp_path):
    mc, out = tmp_path / "mc", tmp_path / "out"
    assert runner.invoke(app, ["convert", str(models["tiny"]), str(mc), "--to", "torch_dist",
                               "--no-progress"]).exit_code == 0
    proc = subprocess.run([sys.executable, "-c", KILLER, str(mc), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()
    staging = [n for n in os.listdir(tmp_path) if ".ckpt-staging-" in n]
    assert len(staging) == 1 and any(
        p.name.endswith(".safetensors") for p in (tmp_path / staging[0]).iterdir())
    result = runner.invoke(app, ["validate", str(out)])
    assert result.exit_code == 2 and "interrupted write" in result.output
    result = runner.invoke(app, ["convert", str(mc), str(out), "--to", "hf", "--no-progress"])
    assert result.exit_code == 0 and "reclaim" in result.output, result.output
    assert not [n for n in os.listdir(tmp_path) if ".ckpt-staging-" in n]
