"""``diff --resharded``: after a reshard, the weights and the optimizer state compare equal
across layouts (TP/PP/EP, legacy or dist, bucketed or model-space optimizer state, a re-padded
vocabulary), what a reshard changes by design is a note, and a real difference still counts."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.ops.diff import RESHARDED_HINT as HINT
from ckpt_tool.ops.diff import diff
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
runner = CliRunner()


def _resharded(tmp_path: Path, name: str, **req) -> tuple[Path, Path]:
    src = FIX / name
    out = tmp_path / f"{name}-out"
    assert reshard(src, out, ReshardRequest(**req)).written
    return src, out


@pytest.mark.parametrize("name, req, tensors", [
    # dp_reshardable DDP buckets in A, model space in B; the padded vocabulary 128 -> 128
    ("mcore016_gpt_tp2dp2_distopt_buckets", dict(tp=1), 64),
    # the padded vocabulary 128 -> 256 (embedding, output layer and their Adam state)
    ("mcore016_gpt_tp2pp2_bf16_optim", dict(tp=4), 64),
    # a chained dense + expert optimizer (EP2) against one (EP1)
    ("mcore016_moe_ep2_distopt_buckets", dict(ep=1), 60),
    # Megatron-LM legacy files with distrib_optim.pt against torch_dist
    ("megatron_legacy_distopt_tp2dp2", dict(tp=1, to="torch_dist"), 64),
    # the flattened optimizer state of Megatron-Core 0.15
    ("mcore015_gpt_flattened_optim", dict(tp=1), 64),
])
def test_a_reshard_is_identical_in_model_space(tmp_path, name, req, tensors):
    src, out = _resharded(tmp_path, name, **req)
    plain = diff(src, out)
    assert not plain.identical and HINT in plain.notes
    got = diff(src, out, resharded=True)
    assert got.identical, got.to_dict()
    assert got.stats["tensors_compared"] == got.stats["tensors_common"] == tensors
    assert any("the parallel sizes in args" in n for n in got.notes)
    assert any(n.startswith("--resharded: ") for n in got.notes)
    assert diff(out, src, resharded=True).identical  # either way round


def test_the_padded_vocabulary_is_compared_on_the_rows_both_hold(tmp_path):
    src, out = _resharded(tmp_path, "mcore016_gpt_tp2pp2_bf16_optim", tp=4)
    got = diff(src, out, resharded=True)
    [note] = [n for n in got.notes if "re-padded" in n]
    assert "128 rows in A and 256 in B, in 8 tensors" in note
    assert not got.shape_changes and not got.values


def test_values_that_differ_are_still_differences(tmp_path):
    """The same model saved from another layout with other training targets: the weights and
    optimizer state differ, and --resharded says so (exit 1 through the CLI)."""
    other = _resharded(tmp_path, "mcore016_gpt_pp2dp2_distopt_buckets", tp=2, pp=1)[1]
    src = FIX / "mcore016_gpt_tp2dp2_distopt_buckets"
    got = diff(src, other, resharded=True)
    assert not got.identical and got.values
    assert any(v.key.startswith("optimizer.state.") for v in got.values)
    res = runner.invoke(app, ["diff", str(src), str(other), "--resharded"])
    assert res.exit_code == 1 and res.stderr.splitlines()[-1].startswith("DIFFERENT: ")


def test_the_cli_verdict_carries_the_hint_and_resharded_exits_0(tmp_path):
    src, out = _resharded(tmp_path, "mcore016_gpt_tp2pp2_bf16_optim", tp=4)
    res = runner.invoke(app, ["diff", str(src), str(out)])
    assert res.exit_code == 1
    last = res.stderr.splitlines()[-1]
    assert last.startswith("DIFFERENT: ") and last.endswith(f"({HINT})")
    res = runner.invoke(app, ["diff", str(src), str(out), "--resharded"])
    assert res.exit_code == 0, res.output
    assert res.stdout == ""  # nothing differs: no table
    assert res.stderr.splitlines()[-1].startswith("identical: ")
    assert any(line.startswith("note: expected after a reshard: ")
               for line in res.stderr.splitlines())
