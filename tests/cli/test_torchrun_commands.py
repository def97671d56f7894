"""Commands under ``torchrun -m ckpt_tool``: work split over ranks, output equal to one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.integrity_manifest import write_manifest
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.diff import diff
from ckpt_tool.ops.reshard import ReshardRequest, reshard

pytestmark = pytest.mark.multiproc
REPO = Path(__file__).resolve().parents[2]
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", "-m", "ckpt_tool", *args],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_convert_and_reshard_split_over_ranks_equal_one_process(tmp_path):
    proc = _torchrun("convert", str(OPTIM), str(tmp_path / "k2"), "--to", "torch_dist", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # one JSON document: only rank 0 prints
    assert doc["verified"] and doc["tensors"] == 64
    # a save directory gives a save directory, also under torchrun
    assert (tmp_path / "k2" / "latest_checkpointed_iteration.txt").read_text() == "10"
    files = sorted(p.name for p in (tmp_path / "k2" / "iter_0000010").glob("*.distcp"))
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    convert(OPTIM, tmp_path / "k1", ConvertOptions(to="torch_dist"))
    same = diff(tmp_path / "k1", tmp_path / "k2")
    assert same.identical and same.stats["tensors_equal_bytes"] == 64

    proc = _torchrun("reshard", str(OPTIM), str(tmp_path / "r2"), "--tp", "1", "--pp", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "r2" / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert "resume with Megatron-LM: --load" in proc.stderr  # rank 0's recipe, once
    assert proc.stderr.count("resume with Megatron-LM") == 1
    resharded = diff(OPTIM, tmp_path / "r2")
    assert not resharded.values and resharded.stats["tensors_compared"] == 64  # args differ

    proc = _torchrun("reshard", str(OPTIM), str(tmp_path / "l2"), "--tp", "4", "--pp", "1",
                     "--to", "legacy", "--drop-optimizer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    reshard(OPTIM, tmp_path / "l1", ReshardRequest(tp=4, pp=1, to="legacy",
                                                   drop_optimizer=True))
    assert diff(tmp_path / "l1", tmp_path / "l2").identical


def test_diff_splits_tensors_and_agrees_on_the_verdict(tmp_path):
    import torch

    out = tmp_path / "st"
    convert(OPTIM, out, ConvertOptions(to="safetensors"))
    proc = _torchrun("diff", str(OPTIM), str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["stats"]["tensors_compared"] == 64

    from safetensors.torch import load_file, save_file

    f = next(out.glob("*.safetensors"))
    data = load_file(f)
    key = sorted(data)[-1]
    data[key] = data[key].clone()
    data[key].view(-1)[0] += 1
    save_file(data, f, metadata={"format": "pt"})
    write_manifest(out)  # an intended change: its manifest rewritten (else diff refuses it)
    proc = _torchrun("diff", str(OPTIM), str(out), "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]  # every rank exits 1, not only one
    doc = json.loads(proc.stdout)
    assert [v["key"] for v in doc["values"]] == [key]
    del torch


def test_validate_deep_splits_files_and_reports_every_finding(tmp_path):
    import shutil
    import struct
    import zipfile

    src = REPO / "fixtures" / "megatron_legacy_tp2pp2"
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    for rank_file in sorted(bad.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[1::2]:
        info = [i for i in zipfile.ZipFile(rank_file).infolist() if "/data/" in i.filename][3]
        data = bytearray(rank_file.read_bytes())
        h = info.header_offset
        n, e = struct.unpack("<HH", data[h + 26:h + 30])
        data[h + 30 + n + e + 5] ^= 0xFF
        rank_file.write_bytes(bytes(data))
    proc = _torchrun("validate", "--deep", str(bad), "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    findings = json.loads(proc.stdout)["findings"]
    damaged = sorted(f["file"] for f in findings if "CRC" in f["message"])
    assert damaged == ["mp_rank_00_001/model_optim_rng.pt", "mp_rank_01_001/model_optim_rng.pt"]
    proc = _torchrun("validate", "--deep", str(src), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["findings"] == []


def _flip_data_byte(ck: Path, key: str, at: int) -> None:
    """Flip one byte of the tensor data of one DCP item of ``key`` (its CRC-32 then fails)."""
    import io
    import struct
    import zipfile

    from ckpt_tool.formats.base import open_checkpoint

    with open_checkpoint(ck) as r:
        chunk = r.metadata().tensors[key].chunks[-1]
    path = ck / chunk.file
    data = bytearray(path.read_bytes())
    item = bytes(data[chunk.byte_offset:chunk.byte_offset + chunk.byte_length])
    info = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist()
                if "/data/" in i.filename)
    n, e = struct.unpack("<HH", item[info.header_offset + 26:info.header_offset + 30])
    data[chunk.byte_offset + info.header_offset + 30 + n + e + at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_damaged_item_read_by_one_rank_fails_the_whole_command(tmp_path):
    """Under torchrun each rank reads its share: whichever rank meets the damaged item, the
    command fails (exit 1) and nothing appears at the target."""
    import shutil

    bad = tmp_path / "bad" / "iter_0000010"
    shutil.copytree(OPTIM / "iter_0000010", bad)
    _flip_data_byte(bad, "optimizer.state.exp_avg.output_layer.weight", 7)
    for args in (("convert", str(bad), str(tmp_path / "c"), "--to", "torch_dist"),
                 ("convert", str(bad), str(tmp_path / "s"), "--to", "safetensors"),
                 ("reshard", str(bad), str(tmp_path / "r"), "--tp", "1", "--pp", "1")):
        proc = _torchrun(*args)
        assert proc.returncode == 1, (args, proc.stderr[-3000:])
        # the rank that met it says which item (torchrun's summary shows it), the others
        # that a rank failed
        errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ckpt: error:")]
        assert errors and "fails its CRC-32 check" in proc.stderr, proc.stderr[-3000:]
        assert not Path(args[2]).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no staging left


PROGRESS_WORKER = r'''
import sys
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.reshard import reshard, ReshardRequest
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.parallel import ranks


class Bar:
    def start(self, total_bytes, total_tensors):
        self.total, self.seen = total_bytes, 0

    def update(self, nbytes, tensors_done):
        self.seen += nbytes


r = ranks()
for name, run in (("convert", lambda p: convert(sys.argv[1], sys.argv[2] + "/c",
                                                 ConvertOptions(to="torch_dist"), progress=p)),
                  ("reshard", lambda p: reshard(sys.argv[1], sys.argv[2] + "/r",
                                                 ReshardRequest(tp=1, pp=1), progress=p))):
    bar = Bar()
    res = run(bar)
    assert bar.seen == bar.total == res.nbytes, (name, bar.seen, bar.total, res.nbytes)
# this script never destroys its group: ranks() must have registered the exit handler that
# lets gloo's workers go idle first, or the exit may end in SIGABRT (CI, stop 22)
from ckpt_tool import _torchrun
assert _torchrun._exit_teardown_registered
print(f"rank {r.rank}: progress OK")
'''


def test_progress_counts_every_ranks_bytes(tmp_path):
    worker = tmp_path / "progress_worker.py"
    worker.write_text(PROGRESS_WORKER)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(worker), str(OPTIM), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("progress OK") == 2


def test_verification_split_over_ranks_fails_every_rank_on_a_corrupt_byte(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "dist_checkpointing" / "_workers"))
    from launch import torchrun

    out = tmp_path / "k"
    convert(OPTIM, out, ConvertOptions(to="torch_dist"))
    clean = torchrun("verify_worker.py", 2, str(out))
    assert "rank 0: verified" in clean and "rank 1: verified" in clean, clean[-2000:]
    last = sorted(out.glob("iter_*/*.distcp"))[-1]  # scanned by one rank only
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(data)
    bad = torchrun("verify_worker.py", 2, str(out))
    for rank in (0, 1):
        assert f"rank {rank}: raised: the converted checkpoint does not validate" in bad, \
            bad[-2000:]
