"""Commands over several nodes as users launch them: one ``torchrun --nnodes 2 --node-rank i``
agent per node (static rendezvous on the first node's address), here two agents on one
machine at 127.0.0.1. The output equals one process's, and every node writes its share of
the data files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.diff import diff
from ckpt_tool.ops.reshard import ReshardRequest, reshard

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the command, run as torchrun's worker; at exit it records how many bytes this process wrote
# (``wchar`` of /proc/self/io: every write() call, the data files included)
WORKER = """
import atexit, os, runpy, sys

def report():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    with open(os.path.join({out!r}, "wchar." + os.environ["RANK"]), "w") as f:
        f.write(fields["wchar"])

atexit.register(report)
sys.argv = ["ckpt", *sys.argv[1:]]
runpy.run_module("ckpt_tool", run_name="__main__", alter_sys=True)
"""


def _two_nodes(tmp: Path, *args: str) -> list[int]:
    """``torchrun --nnodes 2 --node-rank {0,1} --nproc-per-node 1 --master-addr 127.0.0.1
    -m ckpt_tool ARGS``: the two agents started as two nodes' would be; returns the bytes
    each node's process wrote."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    stats = tmp / f"wchar-{len(list(tmp.glob('wchar-*')))}"
    stats.mkdir()
    worker = stats / "worker.py"
    worker.write_text(WORKER.format(out=str(stats)))
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
         str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(port), str(worker), *args],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    return [int((stats / f"wchar.{rank}").read_text()) for rank in (0, 1)]


def _each_wrote_its_share(written: list[int], output: Path) -> None:
    total = sum(f.stat().st_size for f in output.glob("*.distcp"))
    assert sum(written) >= total
    assert min(written) > 0.25 * total, (written, total)


def test_convert_and_reshard_on_two_nodes_equal_one_process(tmp_path):
    written = _two_nodes(tmp_path, "convert", str(OPTIM), str(tmp_path / "c2"), "--to",
                         "torch_dist")
    _each_wrote_its_share(written, tmp_path / "c2")
    convert(OPTIM, tmp_path / "c1", ConvertOptions(to="torch_dist"))
    assert diff(tmp_path / "c1", tmp_path / "c2").identical

    written = _two_nodes(tmp_path, "reshard", str(OPTIM), str(tmp_path / "r2"), "--tp", "4",
                         "--pp", "1")
    _each_wrote_its_share(written, tmp_path / "r2")
    reshard(OPTIM, tmp_path / "r1", ReshardRequest(tp=4, pp=1))
    assert diff(tmp_path / "r1", tmp_path / "r2").identical


def test_ranks_started_without_torchrun_as_srun_starts_them(tmp_path):
    """One process per rank with ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set
    (what an ``srun`` line sets from ``SLURM_PROCID``/``SLURM_NTASKS``): the same output."""
    port = str(_free_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "ckpt_tool", "reshard", str(OPTIM), str(tmp_path / "r2"),
         "--tp", "4", "--pp", "1"],
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
                 PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", RANK=str(rank), LOCAL_RANK="0",
                 WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    reshard(OPTIM, tmp_path / "r1", ReshardRequest(tp=4, pp=1))
    assert diff(tmp_path / "r1", tmp_path / "r2").identical
