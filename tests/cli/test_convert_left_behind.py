"""A conversion that leaves something of the source behind says what, in one note line with
counts by kind (``--to hf`` included), and ``--json`` lists the counts (``left_behind``); a
conversion that keeps everything says nothing of the kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.model import is_optimizer_key

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"
LLAMA = FIX / "mcore016_llama_tp2pp2_distopt"
OPTIM = FIX / "mcore016_gpt_tp2pp2_bf16_optim"


def _source_counts(path: Path) -> tuple[int, int, int]:
    with open_checkpoint(path) as reader:
        meta = reader.metadata()
    return (sum(is_optimizer_key(k) for k in meta.tensors), len(meta.objects),
            len(meta.common["keys"]))


def _left_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("note: left behind")]


def test_hf_export_says_what_it_leaves_behind(tmp_path):
    optimizer, objects, common = _source_counts(LLAMA)
    assert optimizer and objects and common  # (the fixture has all three to leave)
    res = runner.invoke(app, ["convert", str(LLAMA), str(tmp_path / "hf"), "--to", "hf"])
    assert res.exit_code == 0, res.output
    lines = _left_lines(res.stderr)
    assert lines == [f"note: left behind (not in the output): {optimizer} optimizer tensors, "
                     f"{objects} objects, {common} common-state fields (--json lists them)"]
    res = runner.invoke(app, ["convert", str(LLAMA), str(tmp_path / "hf2"), "--to", "hf",
                              "--json", "-q"])
    assert json.loads(res.stdout)["left_behind"] == {
        "optimizer tensors": optimizer, "objects": objects, "common-state fields": common}


@pytest.mark.parametrize("to,extra,kinds", [
    ("safetensors", [], {"objects", "common-state fields"}),
    ("torch_dist", ["--model-only"], {"optimizer tensors"}),
    ("legacy", [], {"optimizer tensors"}),
])
def test_one_note_line_counts_by_kind(tmp_path, to, extra, kinds):
    res = runner.invoke(app, ["convert", str(OPTIM), str(tmp_path / "o"), "--to", to, *extra,
                              "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["left_behind"]) == kinds
    assert len(_left_lines(res.stderr)) == 1
    # the notes it sums up are not printed again (they stay in the JSON document)
    assert not [line for line in res.stderr.splitlines()
                if line.startswith(("note: dropped ", "note: left out "))]


def test_a_conversion_that_keeps_everything_says_nothing_of_it(tmp_path):
    res = runner.invoke(app, ["convert", str(OPTIM), str(tmp_path / "o"), "--to", "torch_dist",
                              "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["left_behind"] == {}
    assert not _left_lines(res.stderr)
