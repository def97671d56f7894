"""Checkpoints the REAL Megatron-Core 0.14 and 0.19 wrote (``fixtures/mcore014_*``,
``fixtures/mcore019_*``: the tiny GPT with a DistributedOptimizer after two Adam steps, and the
per-parameter ground truth the generating run recorded in ``expected/optim.safetensors``),
resharded and resumed by the real Megatron-Core: 0.14's default ``fully_sharded_model_space``
by 0.16.1 (the migration Megatron-Core's docs leave to "a dummy GPU job on 0.15"), 0.19's
``dp_reshardable`` by 0.19 itself (from Megatron-LM's source; skipped, saying why, where it or
``triton`` cannot be had). After resuming, on every rank every bf16 model parameter and every
fp32 main parameter, ``exp_avg`` and ``exp_avg_sq`` slice is bit-identical to the ground truth.
The 0.19 output keeps 0.19's form: one common state, the ``common_state`` object, no
``common.pt``, ``metadata.json`` as 0.19 writes it, an ``integrity.json`` 0.19 verifies."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun, torchrun_outcome  # noqa: E402

from _mcore019 import source_or_skip  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE014 = FIXTURES / "mcore014_gpt_tp2dp2_distopt_flattened"
MCORE019 = FIXTURES / "mcore019_gpt_tp2dp2_distopt_buckets"
RESUME = Path(__file__).resolve().parent / "_moe_resume_worker.py"
API = Path(__file__).resolve().parent / "_mcore019_api_worker.py"


def _resume(out: Path, fixture: Path, tp: int, pp: int, world: int, *extra: str) -> str:
    """The real Megatron-Core resumes from ``out`` at TP x PP and compares with the fixture's
    ground truth (``_moe_resume_worker.py``, the fixture's generate.py ``init``/``build``)."""
    out = locate_source(out).checkpoint  # (in its save directory, as the fixture's)
    log = torchrun(str(RESUME), world, str(tp), str(pp), "1", str(out), fixture.name, *extra,
                   timeout=900)
    assert log.count(": OK ") == world, log[-3000:]
    return log


@pytest.mark.parametrize("tp,pp,world", [
    (2, 1, 4),   # the same layout: only the optimizer's form changes
    (1, 1, 2),   # tp 2 -> 1, dp 2
    (1, 1, 4),   # tp 2 -> 1, dp 2 -> 4
    (2, 2, 4),   # pp 1 -> 2, dp 2 -> 1
])
def test_megatron_core_016_resumes_a_014_checkpoint_resharded(tmp_path, tp, pp, world):
    pytest.importorskip("megatron.core")
    from ckpt_tool.formats.base import open_checkpoint

    out = tmp_path / "out"
    assert reshard(MCORE014, out, ReshardRequest(tp=tp, pp=pp)).written
    ours = open_checkpoint(out)
    assert ours.metadata().extras["optimizer_sharding"]["type"] == "fully_reshardable"
    assert (locate_source(out).checkpoint / "common.pt").is_file()  # 0.14's form
    assert not ours.objects_in_common()
    assert "(megatron-core 0.16.1)" in _resume(out, MCORE014, tp, pp, world)


def test_megatron_core_016_refuses_the_014_checkpoint_as_it_is():
    """Why the reshard: 0.16.1 no longer loads 0.14's flattened optimizer state, even at the
    layout that saved it."""
    pytest.importorskip("megatron.core")
    code, log, _cmd = torchrun_outcome(str(RESUME), 4, "2", "1", "1",
                                       str(next(MCORE014.glob("iter_*"))), MCORE014.name,
                                       timeout=900)
    assert code != 0 and "flattened_range is not supported" in log, log[-3000:]


def _assert_019_form(out: Path, tp: int) -> None:
    """What Megatron-Core 0.19 writes: no common.pt, exactly one common state (the
    common_state object, with the new layout's args), its metadata.json, an integrity.json."""
    from ckpt_tool.formats.base import open_checkpoint

    out = locate_source(out).checkpoint  # (in its save directory, as the fixture's)
    assert not (out / "common.pt").exists()
    assert (out / "metadata.json").read_bytes() == \
        b'{"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    reader = open_checkpoint(out)
    common = [o.unique_key for o in reader.metadata().objects if o.key == "common_state"]
    assert common == ["common_state/shard_0_1"]
    assert reader.common()["args"].tensor_model_parallel_size == tp
    manifest = json.loads((out / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256"
    assert sorted(manifest["files"]) == sorted(p.name for p in out.iterdir()
                                               if p.name != "integrity.json")


@pytest.mark.parametrize("tp,pp,world", [
    (1, 1, 2),   # tp 2 -> 1, dp 2
    (1, 2, 4),   # tp 2 -> 1, pp 1 -> 2, dp 2
])
def test_megatron_core_019_resumes_its_checkpoint_resharded_in_its_own_form(
        tmp_path, monkeypatch, tp, pp, world):
    source_or_skip(monkeypatch)
    out = tmp_path / "out"
    assert reshard(MCORE019, out, ReshardRequest(tp=tp, pp=pp)).written
    _assert_019_form(out, tp)
    log = _resume(out, MCORE019, tp, pp, world, "--verify-integrity")
    assert "(megatron-core 0.19" in log


def test_library_api_reads_what_megatron_core_019_reads(tmp_path, monkeypatch):
    """``load_common_state_dict`` and ``load_plain_tensors`` of ours and of the real 0.19 on
    0.19's checkpoint, on our reshard of it, and on a directory holding two common states
    (``common.pt`` wins in both); an interrupted 0.19 save (no metadata.json) both refuse."""
    import shutil

    import torch

    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.core import CheckpointingException
    from ckpt_tool.formats.containers.torch_zip.torch_save_object import save_object

    source_or_skip(monkeypatch)
    src = next(MCORE019.glob("iter_*"))
    resharded = tmp_path / "tp1"
    reshard(MCORE019, resharded, ReshardRequest(tp=1))
    resharded = locate_source(resharded).checkpoint  # (in its save directory)
    both = tmp_path / "both"
    shutil.copytree(src, both)
    (both / "integrity.json").unlink()
    common = dc.load_common_state_dict(src)
    common["iteration"] = 11
    save_object(common, both / "common.pt")
    interrupted = tmp_path / "interrupted"
    shutil.copytree(src, interrupted)
    (interrupted / "metadata.json").unlink()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    dirs = [src, resharded, both, interrupted]
    log = torchrun(str(API), 1, str(theirs), *map(str, dirs), timeout=900)
    assert "megatron-core 0.19" in log, log[-3000:]
    for n, d in enumerate(dirs[:3]):
        real = torch.load(theirs / f"{n}.pt", weights_only=False)
        mine_common = dc.load_common_state_dict(d)
        assert sorted(mine_common) == sorted(real["common"])
        assert vars(mine_common["args"]) == vars(real["common"]["args"])
        assert mine_common["iteration"] == real["common"]["iteration"] == (11 if d == both
                                                                           else 10)
        mine_plain = dc.load_plain_tensors(d)
        assert sorted(mine_plain) == sorted(real["plain"])
        for key, value in real["plain"].items():
            if torch.is_tensor(value):
                assert torch.equal(mine_plain[key], value), (d, key)
    assert "is not a distributed checkpoint" in (theirs / "3.error").read_text()
    with pytest.raises(CheckpointingException, match="not a distributed checkpoint"):
        dc.load_common_state_dict(interrupted)
