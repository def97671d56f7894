"""Issue 16 item 4: the common state survives every conversion whose format can hold it, and
``diff`` against the source says exactly what a format cannot hold (one note naming the parts
lost), not a pile of differences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

REPO = Path(__file__).resolve().parents[2]
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"
LEGACY = REPO / "fixtures" / "megatron_legacy_tp2pp2"


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def _convert_and_diff(src: Path, out: Path, to: str) -> dict:
    res = _run("convert", str(src), str(out), "--to", to, "--quiet", "--no-verify")
    assert res.exit_code == 0, res.output
    res = _run("diff", str(src), str(out), "--json", "--quiet")
    doc = json.loads(res.stdout)
    assert res.exit_code == 0, (doc["common"][:5], doc["objects_only_in_a"][:5],
                                doc["objects_only_in_b"][:5], doc["only_in_b"][:5])
    return doc


@pytest.mark.parametrize("src", [OPTIM, LEGACY], ids=["torch_dist", "legacy"])
def test_dcp_output_diffs_clean_with_its_source(tmp_path, src):
    doc = _convert_and_diff(src, tmp_path / "dcp", "dcp")
    assert doc["identical"] and doc["common"] == [] and doc["notes"] == []


def test_dcp_common_state_is_nested_again_param_groups_a_list(tmp_path):
    from ckpt_tool.formats.base import open_checkpoint

    _run("convert", str(OPTIM), str(tmp_path / "dcp"), "--to", "dcp", "--quiet", "--no-verify")
    with open_checkpoint(tmp_path / "dcp") as r:
        common = r.common()
        groups = common["optimizer"]["optimizer"]["param_groups"]
        assert isinstance(groups, list) and len(groups) == 2 and "lr" in groups[0]
        assert not any("/shard_" in k for k in common)  # ShardedObjects stay objects
        assert {o.unique_key for o in r.metadata().objects} - r.objects_in_common() == {
            o.unique_key for o in open_checkpoint(OPTIM).metadata().objects}


def test_legacy_to_torch_dist_diffs_clean_with_its_source(tmp_path):
    """Legacy files -> Megatron-Core's stacked names, _extra_state and rng_state objects: diff
    sees the legacy side that way (and says so), and then nothing differs."""
    doc = _convert_and_diff(LEGACY, tmp_path / "td", "torch_dist")
    assert doc["identical"] and doc["notes"] == [
        "A (legacy) seen as Megatron-Core saves it, as convert writes it to a dist format: "
        "stacked layers, _extra_state and rng_state objects"]
    assert doc["stats"]["tensors_equal_bytes"] == 17


def test_safetensors_note_names_what_it_cannot_hold(tmp_path):
    out = tmp_path / "st"
    doc = _convert_and_diff(OPTIM, out, "safetensors")
    assert doc["identical"] and doc["common"] == []
    objects, common = doc["notes"]
    assert objects.startswith("stored objects not compared: B (safetensors) holds none; A's: ")
    assert "rng_state ×4" in objects
    assert common.startswith("common state not compared: B (safetensors) holds none; A's: ")
    assert "args" in common and "iteration" in common
    res = _run("diff", str(OPTIM), str(out))  # the same notes on stderr, exit 0
    assert res.exit_code == 0 and "B (safetensors) holds none" in res.stderr
