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
    result = runner.invoke(app, ["validate", *map(str, args), "--json"])
    assert "Traceback" not in result.output, result.output
    findings = json.loads(result.stdout) if result.exit_code in (0, 1) else None
    return result, findings


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
    result, _ = _run(MCORE, "--expect-keys", tmp_path / "nope.txt")
    assert result.exit_code == 2


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
    assert result.output.strip().startswith("ckpt: error:")


def test_deep_reports_nan(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_api

    w = torch.zeros(8, dtype=torch.bfloat16)
    w[3] = float("nan")
    dcp_api.save({"w": w}, checkpoint_id=tmp_path / "ck", no_dist=True)
    result, findings = _run(tmp_path / "ck", "--deep")
    assert result.exit_code == 0
    assert findings == [{"severity": "warning", "key": "w", "file": None,
                         "message": "1 NaN and 0 Inf of 8 elements"}]
