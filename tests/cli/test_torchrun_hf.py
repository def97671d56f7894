"""HF -> torch_dist and ``convert --to hf`` under ``torchrun -m ckpt_tool``: the ranks split the
output files (DCP items; whole safetensors shards) and the result equals one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.diff import diff

sys.path.insert(0, str(Path(__file__).parent))
from _hf_dirs import llama_dir  # noqa: E402

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "-m", "ckpt_tool", *map(str, args)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_to_torch_dist_and_back_split_over_ranks_equal_one_process(tmp_path):
    # ~530 KB of fp32 weights: 5 shards of at most 100 KB to split over the 2 ranks
    hf = llama_dir(tmp_path / "llama", hidden=64, inter=96, heads=4, kv=2, vocab=512)
    proc = _torchrun("convert", hf, tmp_path / "mc", "--to", "torch_dist", "--tp", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "mc").glob("*.distcp"))
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    assert diff(hf, tmp_path / "mc").identical  # names mapped through the rules

    two, one = tmp_path / "hf2", tmp_path / "hf1"
    proc = _torchrun("convert", tmp_path / "mc", two, "--to", "hf", "--max-shard-size",
                     "100KB", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # one JSON document: only rank 0 prints
    assert doc["verified"] and doc["tensors"] == 21 and doc["format"] == "hf"
    convert(tmp_path / "mc", one, ConvertOptions(to="hf"), max_shard_size=100_000)
    names = sorted(p.name for p in one.iterdir() if p.name != "ckpt-manifest.json")
    assert len([n for n in names if n.endswith(".safetensors")]) == 5
    assert names == sorted(p.name for p in two.iterdir() if p.name != "ckpt-manifest.json")
    for name in names:  # every shard, the index and config.json byte for byte
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert diff(tmp_path / "mc", two).identical  # the export holds what the import wrote
