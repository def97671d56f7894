"""DistributedOptimizer checkpoints the REAL Megatron-Core 0.16.1 wrote without Megatron-LM
``args`` — a script's own ``dist_checkpointing.save`` (``mcore016_gpt_tp2dp2_distopt_noargs``:
the bucket layout comes from the stored ``per_bucket_numel_unpadded`` and pieces alone, or for
``dp_zero_gather_scatter`` from ``--ddp-bucket-size``), Megatron-Bridge's save
(``mcore016_gpt_tp2dp2_distopt_bridge``: from its ``run_config.yaml``; the output a Bridge save
directory again) and NeMo 2's (``nemo2_mcore016_gpt_tp2dp2_distopt``: ``module.``-prefixed
keys, ``dp_zero_gather_scatter`` with NeMo's unbucketed DDP, ``--ddp-bucket-size 0``; the
output a NeMo checkpoint directory, loaded from its ``weights/`` as NeMo's strategy loads) —
resharded to a new layout: the real Megatron-Core builds the model, DDP and
DistributedOptimizer there, resumes from our output as the framework does, and on every rank
holds fp32 main params, exp_avg and exp_avg_sq bit-identical to what the source's optimizer
held when it saved (the fixture's ``expected/optim.safetensors``), and bf16 params equal to
those main params rounded."""

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
FIX = Path(__file__).resolve().parents[2] / "fixtures"
RAW, BRIDGE = "mcore016_gpt_tp2dp2_distopt_noargs", "mcore016_gpt_tp2dp2_distopt_bridge"
NEMO = "nemo2_mcore016_gpt_tp2dp2_distopt"
NEMO_CKPT = "checkpoints/default--val_loss=0.00-step=1-consumed_samples=4.0-last"
WORKER = Path(__file__).resolve().parent / "_moe_resume_worker.py"


@pytest.mark.parametrize("fixture,source,bucket_size,tp,pp,world", [
    (RAW, "dp_reshardable", None, 1, 1, 2),          # layout from the stored data alone
    (RAW, "dp_zero_gather_scatter", 6000, 1, 2, 4),  # from --ddp-bucket-size
    (BRIDGE, "", None, 1, 1, 2),                      # from run_config.yaml
    (NEMO, NEMO_CKPT, 0, 1, 2, 2),                    # NeMo's keys, its unbucketed DDP
])
def test_megatron_core_resumes_exactly_from_a_reshard_of_a_checkpoint_without_args(
        tmp_path, fixture, source, bucket_size, tp, pp, world):
    pytest.importorskip("megatron.core")
    out = tmp_path / "out"
    result = reshard(FIX / fixture / source, out,
                     ReshardRequest(tp=tp, pp=pp, ddp_bucket_size=bucket_size))
    assert result.written
    ours = open_checkpoint(out)
    assert ours.metadata().extras["optimizer_sharding"]["type"] == "fully_reshardable"
    assert ours.common()["content_metadata"]["distrib_optim_sharding_type"] == \
        "fully_reshardable"
    kind = {BRIDGE: "save_dir", NEMO: "nemo"}.get(fixture, "bare")
    assert result.container.kind == kind
    if fixture == BRIDGE:  # what Bridge's load_checkpoint reads beside the checkpoint
        assert {"run_config.yaml", "train_state.pt"} <= {
            p.name for p in (out / "iter_0000010").iterdir()}
        assert (out / "latest_train_state.pt").is_file()
    if fixture == NEMO:
        assert sorted(p.name for p in out.iterdir()) == ["context", "weights"]
    log = torchrun(str(WORKER), world, str(tp), str(pp), "1",
                   str(locate_source(out).checkpoint), fixture, timeout=900)
    assert log.count(": OK ") == world, log[-3000:]
