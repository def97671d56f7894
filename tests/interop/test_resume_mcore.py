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
