"""MoE checkpoints the REAL Megatron-Core 0.16.1 wrote with the chained DistributedOptimizer in
Megatron-LM's default ``dp_reshardable`` form (dense + expert buffers, EP2, several buckets
each: ``fixtures/mcore016_moe_ep2_distopt_buckets``; with a virtual pipeline, one buffer per
model chunk: ``fixtures/mcore016_moe_pp2vpp2ep2_distopt_buckets``), resharded to a new TP/PP/EP with no
flags: the real Megatron-Core builds the model + DDP + DistributedOptimizer at the new layout,
resumes from our output exactly as Megatron-LM does, and on every rank holds fp32 main params,
exp_avg and exp_avg_sq bit-identical to the per-parameter state the source's optimizers held."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
EP2, VPP = "mcore016_moe_ep2_distopt_buckets", "mcore016_moe_pp2vpp2ep2_distopt_buckets"
WORKER = Path(__file__).resolve().parent / "_moe_resume_worker.py"


@pytest.mark.parametrize("fixture,tp,pp,ep,world", [
    (EP2, 1, 1, 1, 2),   # ep 2 -> 1: the experts join the dense optimizer (one optimizer), dp 2
    (EP2, 2, 1, 2, 4),   # tp 1 -> 2 at ep 2 (expert tp 1): dense dp 2, expert dp 2
    (EP2, 1, 1, 4, 4),   # ep 2 -> 4: one expert per rank, expert dp 1, dense dp 4
    (EP2, 1, 2, 2, 4),   # pp 1 -> 2 at ep 2: dense dp 2, expert dp 1
    (VPP, 1, 1, 1, 2),   # pp 2 vpp 2 ep 2 -> pp 1 ep 1, dp 2
    (VPP, 1, 2, 2, 4),   # the virtual pipeline dropped at pp 2 ep 2
])
def test_megatron_core_resumes_moe_distributed_optimizer_from_buckets(tmp_path, fixture, tp, pp,
                                                                      ep, world):
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    result = reshard(FIXTURES / fixture, out, ReshardRequest(tp=tp, pp=pp, ep=ep))
    assert result.written
    ours = open_checkpoint(out)
    assert ours.metadata().extras["optimizer_sharding"]["type"] == "fully_reshardable"
    optimizer = ours.common()["optimizer"]
    assert sorted(optimizer) == ([0, 1] if ep > 1 else ["optimizer", "param_state_sharding_type"])
    log = torchrun(str(WORKER), world, str(tp), str(pp), str(ep),
                   str(locate_source(out).checkpoint), fixture,
                   timeout=900)
    assert log.count(": OK ") == world, log[-3000:]
    assert f"{2 if ep > 1 else 1} optimizers" in log
