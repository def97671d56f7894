"""``validate --deep`` proves the optimizer state consistent with the model: each fp32 main
parameter, cast to the model's dtype, is the stored weight bit for bit. The REAL Megatron-Core
0.16.1's ``fully_reshardable`` save with several DDP buckets misplaces state between parameters
(``fixtures/mcore016_gpt_tp2dp2_distopt_fullyresh_buckets``): the check names them; the same
model saved ``dp_reshardable`` (and our reshard of it) passes; a reshard output whose state was
moved to another parameter is named."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.ops.reshard import ReshardRequest, reshard
from ckpt_tool.ops.validate import validate

FIX = Path(__file__).resolve().parents[2] / "fixtures"


def test_megatron_cores_misplaced_fully_reshardable_state_is_named():
    r = CliRunner().invoke(app, ["validate", str(FIX / "mcore016_gpt_tp2dp2_distopt_fullyresh_buckets"),
                                 "--deep", "--json"])
    assert r.exit_code == 1
    found = json.loads(r.stdout)["findings"]
    named = {f["key"] for f in found if "does not round to the stored weight" in f["message"]}
    assert "decoder.layers.self_attention.linear_qkv.weight" in named
    assert len(named) >= 5


def test_consistent_state_passes_and_is_counted(tmp_path):
    src = FIX / "mcore016_gpt_tp2dp2_distopt_buckets"
    result = validate(src, deep=True)
    assert not result.errors and result.stats["optimizer_params_checked"] == 16
    out = tmp_path / "tp1"
    reshard(src, out, ReshardRequest(tp=1))
    result = validate(out, deep=True)
    assert not result.errors and result.stats["optimizer_params_checked"] == 16


def test_state_moved_to_another_parameter_is_named(tmp_path, monkeypatch):
    """A conversion that swaps two same-shaped parameters' optimizer state (simulated on the
    read path, as a planning error would) is named for both parameters."""
    from ckpt_tool.ops import _optim_unflatten as U

    out = tmp_path / "tp1"
    reshard(FIX / "mcore016_gpt_tp2dp2_distopt_buckets", out, ReshardRequest(tp=1))
    a = "optimizer.state.param.decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    b = "optimizer.state.param.decoder.layers.mlp.linear_fc1.layer_norm_weight"
    real = U.unflatten_bucketed_optimizer

    def swapped(reader, *args, **kwargs):
        view = real(reader, *args, **kwargs)
        read = view.read
        view.read = lambda key, s=None: read({a: b, b: a}.get(key, key), s)
        return view

    monkeypatch.setattr(U, "unflatten_bucketed_optimizer", swapped)
    result = validate(out, deep=True)
    assert {f.key for f in result.errors} == {
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight"}
