"""``ckpt validate``: exit codes (0 valid, 1 findings, 2 unreadable), JSON findings, table."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
ZARR = FIXTURES / "mcore015_zarr_gpt_tp2pp2" / "iter_0000010"
DCP = FIXTURES / "dcp_plain"


def _run(*args):
    """``ckpt validate ARGS --json``: the result and the verdict's findings (JSON on stdout for
    every exit code but a usage error)."""
    result = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert "Traceback" not in result.output, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] is (result.exit_code == 0)
    assert doc["counts"]["errors"] == sum(f["severity"] == "error" for f in doc["findings"])
    return result, doc["findings"]


@pytest.fixture
def mcore(tmp_path):
    return Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))


@pytest.mark.parametrize("path", [MCORE, MCORE.parent, ZARR, DCP])
def test_valid_fixtures_exit_0(path):
    result, findings = _run(path)
    assert result.exit_code == 0, result.output
    assert findings == []
    assert "valid:" in result.stderr


def test_table_output_and_verdict(mcore):
    (mcore / "__1_0.distcp").unlink()
    result = runner.invoke(app, ["validate", str(mcore)])
    assert result.exit_code == 1
    assert "__1_0.distcp" in result.stdout and "error" in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("INVALID:")


def test_truncated_distcp_names_the_file(mcore):
    with open(mcore / "__0_1.distcp", "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    result, findings = _run(mcore)
    assert result.exit_code == 1
    assert any(f["file"] == "__0_1.distcp" and "truncated" in f["message"] for f in findings)
    assert set(findings[0]) == {"severity", "key", "file", "message"}


def test_deleted_distcp(mcore):
    (mcore / "__2_0.distcp").unlink()
    result, findings = _run(mcore)
    assert result.exit_code == 1
    assert any(f["file"] == "__2_0.distcp" and "missing" in f["message"] for f in findings)


def test_stale_distcp_is_a_warning(mcore):
    shutil.copy(mcore / "__0_0.distcp", mcore / "__4_0.distcp")
    result, findings = _run(mcore)
    assert result.exit_code == 0
    assert [(f["severity"], f["file"]) for f in findings] == [("warning", "__4_0.distcp")]


def test_missing_metadata_json_exits_1(mcore):
    (mcore / "metadata.json").unlink()
    result, findings = _run(mcore)
    assert result.exit_code == 1
    assert findings[0]["file"] == "metadata.json"
    assert "not a complete checkpoint" in findings[0]["message"]


def test_interrupted_save_without_any_metadata_exits_1(mcore):
    (mcore / "metadata.json").unlink()
    (mcore / ".metadata").rename(mcore / ".metadata.tmp")
    result, findings = _run(mcore)
    assert result.exit_code == 1
    assert [f["file"] for f in findings] == [".metadata"]


def test_tracker_points_at_missing_iteration(tmp_path):
    save = tmp_path / "save"
    shutil.copytree(MCORE, save / "iter_0000010")
    (save / "latest_checkpointed_iteration.txt").write_text("30\n")
    result, findings = _run(save)
    assert result.exit_code == 1
    assert findings[0]["file"] == "latest_checkpointed_iteration.txt"
    assert "iter_0000030" in findings[0]["message"]


def test_expect_tp_pp_iteration():
    result, findings = _run(MCORE, "--expect-tp", 2, "--expect-pp", 2, "--expect-iteration", 10)
    assert result.exit_code == 0 and findings == []
    result, findings = _run(MCORE, "--expect-tp", 4)
    assert result.exit_code == 1
    assert len(findings) == 1
    assert "tp=4" in findings[0]["message"] and "tp=2" in findings[0]["message"]


def test_expect_keys(tmp_path):
    from ckpt_tool.ops.inspect import inspect

    key = sorted(inspect(MCORE).meta.tensors)[0]
    f = tmp_path / "keys.txt"
    f.write_text(f"# wanted\n{key}\n\nmissing.key.weight\n")
    result, findings = _run(MCORE, "--expect-keys", f)
    assert result.exit_code == 1
    assert [(x["severity"], x["key"]) for x in findings] == [("error", "missing.key.weight")]


def test_expect_keys_file_missing_exits_2(tmp_path):
    result, findings = _run(MCORE, "--expect-keys", tmp_path / "nope.txt")
    assert result.exit_code == 2
    assert "nope.txt" in findings[0]["message"]


def test_several_problems_all_reported(mcore):
    (mcore / "__3_0.distcp").unlink()
    with open(mcore / "__1_1.distcp", "r+b") as f:
        f.truncate(64)
    (mcore / "junk.tmp").write_text("x")
    result, findings = _run(mcore, "--expect-pp", 4)
    assert result.exit_code == 1
    files = {f["file"] for f in findings}
    assert {"__3_0.distcp", "__1_1.distcp", "junk.tmp"} <= files
    assert any("pp=4" in f["message"] for f in findings)
    assert any(f["severity"] == "warning" for f in findings)


def test_unreadable_input_exits_2(tmp_path):
    result, _ = _run(tmp_path / "missing")
    assert result.exit_code == 2
    (tmp_path / "empty").mkdir()
    result, _ = _run(tmp_path / "empty")
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("ckpt: error:")


def test_deep_reports_nan(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_api

    w = torch.zeros(8, dtype=torch.bfloat16)
    w[3] = float("nan")
    dcp_api.save({"w": w}, checkpoint_id=tmp_path / "ck", no_dist=True)
    result = runner.invoke(app, ["validate", str(tmp_path / "ck"), "--deep", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["findings"] == [{"severity": "warning", "key": "w", "file": None,
                                "message": "1 NaN and 0 Inf of 8 elements"}]
    assert doc["nonfinite"] == {"w": {"nan": 1, "inf": 0, "elements": 8}}
    assert doc["counts"] == {"errors": 0, "warnings": 1, "nan": 1, "inf": 0,
                             "tensors_with_nan_or_inf": 1}
    assert doc["ok"] is True and doc["stats"]["tensors_read"] == 1


def test_deep_clean_checkpoint_has_empty_counts():
    result = runner.invoke(app, ["validate", str(DCP), "--deep", "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["nonfinite"] == {}
    assert doc["counts"] == {"errors": 0, "warnings": 0, "nan": 0, "inf": 0,
                             "tensors_with_nan_or_inf": 0}


def test_json_is_a_verdict_object(mcore):
    (mcore / "__1_0.distcp").unlink()
    (mcore / "junk.tmp").write_text("x")
    result = runner.invoke(app, ["validate", str(mcore), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["ok"] is False and doc["unreadable"] is None
    assert doc["path"] == str(mcore) and doc["format"] == "torch_dist"
    assert doc["counts"] == {"errors": len(doc["findings"]) - 1, "warnings": 1}
    assert doc["counts"]["errors"] >= 1
    assert doc["stats"]["tensors"] > 0 and doc["stats"]["files"] > 0
    assert "nonfinite" not in doc  # only with --deep
    assert result.stderr.strip().splitlines()[-1].startswith("INVALID:")


@pytest.mark.parametrize("make", ["missing", "empty", "random"])
def test_unreadable_input_still_prints_a_verdict_on_stdout(tmp_path, make):
    path = tmp_path / make
    if make == "empty":
        path.mkdir()
    elif make == "random":
        path.write_bytes(bytes(range(256)) * 4)
    result = runner.invoke(app, ["validate", str(path), "--json"])
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("ckpt: error: ")
    assert doc["ok"] is False and doc["format"] is None and doc["path"] == str(path)
    assert doc["unreadable"] == line[len("ckpt: error: "):]
    assert doc["counts"] == {"errors": 1, "warnings": 0}
    assert doc["findings"] == [{"severity": "error", "key": None, "file": None,
                                "message": doc["unreadable"]}]


def test_without_json_an_unreadable_input_prints_nothing_on_stdout(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "missing")])
    assert result.exit_code == 2 and result.stdout == ""
