"""``ckpt reshard`` of DistributedOptimizer checkpoints saved without Megatron-LM ``args``
(fixtures written by the real Megatron-Core 0.16.1: a script's own ``dist_checkpointing.save``,
and Megatron-Bridge's save with its ``run_config.yaml``): where the bucket layout came from is
reported; what the stored data cannot decide is refused in one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app

FIX = Path(__file__).resolve().parents[2] / "fixtures"
RAW = FIX / "mcore016_gpt_tp2dp2_distopt_noargs"
BRIDGE = FIX / "mcore016_gpt_tp2dp2_distopt_bridge"
runner = CliRunner()


def _check(*argv):
    res = runner.invoke(app, ["reshard", *map(str, argv), "--tp", "1", "--check", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    return doc, " ".join(p["reason"] for p in doc["problems"] if p["key"] == "optimizer")


def _refused(tmp_path, *argv):
    out = tmp_path / "out"
    res = runner.invoke(app, ["reshard", *map(str, argv), str(out), "--tp", "1"])
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "Traceback" not in res.stderr and not out.exists()
    return lines[0]


def test_the_layout_comes_from_the_stored_data_alone():
    doc, note = _check(RAW / "dp_reshardable")
    assert doc["source_layout"]["origins"] == {"tp": "chunk grid", "pp": "optimizer domains",
                                               "ep": "no experts"}
    assert "unflattened from dp_reshardable: 10 buckets in 2 model-parallel domains" in note
    assert ("bucket boundaries from per_bucket_numel_unpadded; local parameter order (the "
            "only one that fits); dp 2 (from the stored pieces)") in note


def test_the_layout_comes_from_megatron_bridges_run_config():
    doc, note = _check(BRIDGE)
    assert set(doc["source_layout"]["origins"].values()) == {"Megatron-Bridge run_config.yaml"}
    assert "bucket boundaries from the configuration; local parameter order; dp 2" in note


def test_what_the_stored_data_cannot_decide_is_refused_naming_the_flag(tmp_path):
    line = _refused(tmp_path, RAW / "dp_zero_gather_scatter")
    assert "dp_zero_gather_scatter optimizer state: the DDP bucket size is not in the " \
           "checkpoint's configuration" in line and "--ddp-bucket-size N" in line
    _doc, note = _check(RAW / "dp_zero_gather_scatter", "--ddp-bucket-size", "6000")
    assert "bucket boundaries from --ddp-bucket-size" in note


def test_flags_that_contradict_the_stored_pieces_are_refused(tmp_path):
    for flags in (["--ddp-bucket-size", "100000"], ["--te-spec"]):
        line = _refused(tmp_path, RAW / "dp_reshardable", *flags)
        assert "the rebuilt bucket layout does not match the checkpoint" in line, flags
