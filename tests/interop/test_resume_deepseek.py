"""A DeepSeek-V3-shaped checkpoint the REAL Megatron-Core 0.16.1 wrote
(``fixtures/mcore016_deepseek_tp2ep2_distopt``: Multi-Latent Attention, a dense layer then MoE
layers with a sigmoid router, expert bias, group routing and a gated shared expert, one
Multi-Token-Prediction layer; TP2 EP2, the chained DistributedOptimizer in Megatron-LM's default
``dp_reshardable`` form with several buckets per buffer), resharded to a new TP/EP with no flags:
the real Megatron-Core builds the model + DDP + DistributedOptimizer at the new layout, resumes
from our output exactly as Megatron-LM does, and on every rank holds fp32 main params, exp_avg and
exp_avg_sq bit-identical to the per-parameter state the source's optimizers held, bf16 parameters
equal to them rounded, and the routers' expert bias as saved (``_moe_resume_worker.py``).
The same model written by Megatron-Core 0.19 (``fixtures/mcore019_deepseek_tp2ep2_distopt``) is
resumed by 0.19 itself (from Megatron-LM's source; skipped, saying why, where it or ``triton``
cannot be had).

No pipeline-parallel target: 3 decoder layers and the MTP layer (which Megatron-Core puts on the
last stage) split over 2 stages only with an uneven first/last stage, which the fixture's
``build(tp, pp, ep)`` does not describe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

from _mcore019 import source_or_skip  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE016, MCORE019 = "mcore016_deepseek_tp2ep2_distopt", "mcore019_deepseek_tp2ep2_distopt"
WORKER = Path(__file__).resolve().parent / "_moe_resume_worker.py"
TARGETS = [
    (1, 1, 1, 2),  # tp 2 -> 1, ep 2 -> 1: the experts join the dense optimizer, dp 2
    (2, 1, 1, 2),  # ep 2 -> 1 at tp 2 (expert tp 1): dense dp 1, expert dp 2
    (1, 1, 2, 2),  # tp 2 -> 1 at ep 2: dense dp 2, expert dp 1
]


def _version(fixture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Megatron-Core that wrote ``fixture`` resumes it: 0.16.1 installed, 0.19 from source."""
    pytest.importorskip("megatron.core")
    if fixture == MCORE019:
        source_or_skip(monkeypatch)


def _resume(fixture: str, ckpt: Path, tp: int, pp: int, ep: int, world: int,
            *flags: str) -> str:
    log = torchrun(str(WORKER), world, str(tp), str(pp), str(ep), str(ckpt), fixture, *flags,
                   timeout=900)
    assert log.count(": OK ") == world, log[-3000:]
    assert "3 buffers" in log, log[-3000:]
    return log


@pytest.mark.parametrize("fixture", [MCORE016, MCORE019])
def test_megatron_core_resumes_the_deepseek_fixture_as_saved(monkeypatch, fixture):
    """The fixture itself at its own layout: what the resharded cases compare with is what the
    real Megatron-Core loads from the original."""
    _version(fixture, monkeypatch)
    log = _resume(fixture, locate_source(FIXTURES / fixture).checkpoint, 2, 1, 2, 4)
    assert "2 optimizers" in log


@pytest.mark.parametrize("fixture,tp,pp,ep,world",
                         [(MCORE016, *t) for t in TARGETS] + [(MCORE019, *TARGETS[0])])
def test_megatron_core_resumes_deepseek_distributed_optimizer_after_reshard(
        tmp_path, monkeypatch, fixture, tp, pp, ep, world):
    _version(fixture, monkeypatch)
    out = tmp_path / "out"
    result = reshard(FIXTURES / fixture, out, ReshardRequest(tp=tp, pp=pp, ep=ep))
    assert result.written
    ours = open_checkpoint(out)
    assert ours.metadata().extras["optimizer_sharding"]["type"] == "fully_reshardable"
    optimizer = ours.common()["optimizer"]
    assert sorted(optimizer) == ([0, 1] if ep > 1 else ["optimizer", "param_state_sharding_type"])
    log = _resume(fixture, locate_source(out).checkpoint, tp, pp, ep, world)
    assert f"{2 if ep > 1 else 1} optimizers" in log


@pytest.mark.slow
@pytest.mark.parametrize("fixture,tp,pp,ep,world",
                         [(MCORE016, *t) for t in TARGETS] + [(MCORE019, *TARGETS[0])])
def test_megatron_core_loads_deepseek_model_after_reshard_without_optimizer(
        tmp_path, monkeypatch, fixture, tp, pp, ep, world):
    """``reshard --drop-optimizer``: the model alone (MLA's TP-split projections, the experts
    regrouped over EP, the MTP layer, the routers' expert bias), loaded as Megatron-LM loads with
    ``--no-load-optim``."""
    _version(fixture, monkeypatch)
    out = tmp_path / "out"
    result = reshard(FIXTURES / fixture, out,
                     ReshardRequest(tp=tp, pp=pp, ep=ep, drop_optimizer=True))
    assert result.written
    assert not any(k.startswith(("optimizer", "chained_"))
                   for k in open_checkpoint(out).metadata().tensors)
    log = _resume(fixture, locate_source(out).checkpoint, tp, pp, ep, world, "--model-only")
    assert "0 optimizers" in log
