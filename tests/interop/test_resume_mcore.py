"""Resume at a new layout, as Megatron-LM does, from our reshard of checkpoints the REAL
Megatron-Core 0.16.1 wrote (torchrun/gloo): model-only and non-distributed-optimizer checkpoints
carry Megatron-LM's ``distrib_optim_sharding_type: dp_reshardable`` content metadata and must
reshard with no flags; after resuming, every parameter and every optimizer tensor equals what
Megatron-Core holds after resuming from the source itself (it reshards model-space state on
load)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
FIX = Path(__file__).resolve().parents[2] / "fixtures"
WORKER = Path(__file__).resolve().parent / "_resume_worker.py"


@pytest.mark.parametrize("fixture,kind,tp,pp,world", [
    ("mcore016_gpt_tp2pp2_modelonly", "modelonly", 1, 2, 2),
    ("mcore016_gpt_tp2pp2_modelonly", "modelonly", 4, 1, 4),   # pp 2 -> 1
    ("mcore016_gpt_tp2dp2_fp16opt", "fp16opt", 1, 2, 4),   # tp 2 -> 1, pp 1 -> 2, dp 2
    ("mcore016_gpt_tp2dp2_fp16opt", "fp16opt", 4, 1, 4),   # tp 4 > query groups, dp 1
])
def test_megatron_core_resumes_from_reshard(tmp_path, fixture, kind, tp, pp, world):
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    result = reshard(FIX / fixture, out, ReshardRequest(tp=tp, pp=pp))
    assert result.written
    ref = str(next((FIX / fixture).glob("iter_*")))
    log = torchrun(str(WORKER), world, str(tp), str(pp), kind, ref, str(out), timeout=900)
    assert log.count(": OK ") == world, log[-3000:]


RESAVE = Path(__file__).resolve().parent / "_resave_worker.py"


@pytest.fixture(scope="module")
def distopt_truth(tmp_path_factory):
    """The real Megatron-Core's own model-space re-save of each bucket-space fixture."""
    pytest.importorskip("megatron.core")
    out = {}
    for fixture, tp, pp in (("mcore016_gpt_tp2dp2_distopt_buckets", 2, 1),):
        dst = tmp_path_factory.mktemp(fixture)
        src = str(next((FIX / fixture).glob("iter_*")))
        log = torchrun(str(RESAVE), 4, str(tp), str(pp), "20000", src, str(dst), timeout=900)
        assert log.count(": OK ") == 4, log[-3000:]
        out[fixture] = str(next(dst.glob("iter_*")))
    return out


@pytest.mark.parametrize("fixture,tp,pp,world", [
    ("mcore016_gpt_tp2dp2_distopt_buckets", 1, 1, 2),   # tp 2 -> 1, dp 2
    ("mcore016_gpt_tp2dp2_distopt_buckets", 4, 1, 4),   # tp 2 -> 4, dp 1
    ("mcore016_gpt_tp2dp2_distopt_buckets", 1, 2, 4),   # pp 1 -> 2, dp 2
])
def test_megatron_core_resumes_distributed_optimizer_from_buckets(tmp_path, distopt_truth, fixture,
                                                                   tp, pp, world):
    """dp_reshardable (Megatron-LM's default, per-bucket flat state) at a new TP/PP/DP with no
    flags: after resuming, the DistributedOptimizer holds bit-identical fp32 main params and Adam
    moments to resuming from Megatron-Core's own model-space re-save of the source."""
    out = tmp_path / "out"
    result = reshard(FIX / fixture, out, ReshardRequest(tp=tp, pp=pp))
    assert result.written
    log = torchrun(str(WORKER), world, str(tp), str(pp), "distopt", distopt_truth[fixture],
                   str(out), timeout=900)
    assert log.count(": OK ") == world, log[-3000:]
