"""Every command on the checkpoints of the frontier families the REAL Megatron-Core wrote
(DeepSeek-V3-shaped MLA + MoE + MTP in 0.16.1 and 0.19; grouped-GEMM experts; a hybrid Mamba
model; GPT-OSS-shaped attention sinks and biased experts; each with the DistributedOptimizer's
``dp_reshardable`` buckets): ``inspect`` names the parts, ``validate --deep`` passes and checks
the optimizer state against the model, ``convert`` between the dist formats and ``reshard``
(optimizer included) give what ``diff`` / ``diff --resharded`` call identical. The resumes by the
real Megatron-Core are in tests/interop/test_resume_deepseek.py and test_resume_families.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

pytestmark = pytest.mark.slow
FIX = Path(__file__).resolve().parents[2] / "fixtures"
runner = CliRunner()

# fixture -> (the parts inspect names, a reshard target)
FAMILIES = {
    "mcore016_deepseek_tp2ep2_distopt": ({"attention", "experts", "mtp"}, ["--tp", "1", "--ep", "1"]),
    "mcore019_deepseek_tp2ep2_distopt": ({"attention", "experts", "mtp"}, ["--tp", "1", "--ep", "2"]),
    "mcore016_moe_grouped_ep2_distopt": ({"experts"}, ["--ep", "1"]),
    "mcore016_hybrid_tp2dp2_distopt": ({"mamba"}, ["--tp", "1"]),
    "mcore016_gptoss_ep2_distopt": ({"attention sinks", "experts"}, ["--pp", "1", "--ep", "1"]),
}


def _ckpt(*args):
    res = runner.invoke(app, [str(a) for a in args])
    assert "Traceback" not in res.output, res.output
    return res


@pytest.mark.parametrize("fixture", sorted(FAMILIES))
def test_every_command(tmp_path, fixture):
    src = FIX / fixture
    parts, target = FAMILIES[fixture]
    res = _ckpt("inspect", src, "--json")
    assert res.exit_code == 0
    assert set(json.loads(res.stdout)["model_parts"]) == parts
    res = _ckpt("validate", src, "--deep", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["stats"]["optimizer_params_checked"] >= 10
    for fmt in ("dcp", "zarr"):
        out = tmp_path / fmt
        assert _ckpt("convert", src, out, "--to", fmt).exit_code == 0
        res = _ckpt("diff", src, out)
        assert res.exit_code == 0, res.output
    out = tmp_path / "resharded"
    res = _ckpt("reshard", src, out, *target)
    assert res.exit_code == 0, res.output
    assert "parameter order read off the stored data" in res.output
    assert _ckpt("validate", out, "--deep").exit_code == 0
    res = _ckpt("diff", src, out, "--resharded")
    assert res.exit_code == 0, res.output
