"""``ckpt reshard`` command line: the target layout defaults to the source's (issue 16)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats import open_checkpoint

FIX = Path(__file__).resolve().parents[2] / "fixtures"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"
runner = CliRunner()


def test_pp_and_ep_default_to_the_source_and_check_says_so(tmp_path):
    res = runner.invoke(app, ["reshard", str(DIST), "--tp", "4", "--check"])
    assert res.exit_code == 0, res.output
    assert "target layout: tp4 (--tp)  pp2 (source: args)  ep1 (source: args)" in res.stdout
    assert "tp2 pp2 ep1 -> tp4 pp2 ep1" in res.stderr
    res = runner.invoke(app, ["reshard", str(DIST), "--tp", "4", "--check", "--json"])
    doc = json.loads(res.stdout)
    assert doc["target_layout"]["pp"] == 2
    assert doc["target_layout"]["origins"] == {"tp": "--tp", "pp": "source: args",
                                               "ep": "source: args"}
    # written: PP2 kept (it used to become PP1 silently)
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "o"), "--tp", "4"])
    assert res.exit_code == 0, res.output
    common = open_checkpoint(tmp_path / "o").common()
    assert (common["args"].tensor_model_parallel_size,
            common["args"].pipeline_model_parallel_size) == (4, 2)
    # an explicit --pp wins; --tp too may be left to the source
    res = runner.invoke(app, ["reshard", str(DIST), "--pp", "1", "--check", "--json"])
    doc = json.loads(res.stdout)
    assert (doc["target_layout"]["tp"], doc["target_layout"]["pp"]) == (2, 1)
    assert doc["target_layout"]["origins"]["tp"] == "source: args"


BUCKETED = FIX / "mcore016_gpt_tp2dp2_distopt_buckets"


def test_bucketed_optimizer_check_reports_the_proof_and_a_mismatch_is_one_line(tmp_path):
    res = runner.invoke(app, ["reshard", str(BUCKETED), "--tp", "1", "--check", "--json"])
    assert res.exit_code == 0, res.output
    notes = " ".join(p["reason"] for p in json.loads(res.stdout)["problems"])
    assert "unflattened from dp_reshardable: 8 buckets in 2" in notes
    # the wrong layer spec given (a local-spec model): the flag decides, the proof refuses it
    res = runner.invoke(app, ["reshard", str(BUCKETED), str(tmp_path / "o"), "--tp", "1",
                              "--te-spec"])
    assert res.exit_code == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "does not match the checkpoint" in lines[0], res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()


def test_a_reshard_that_works_is_quiet(tmp_path):
    """The feasibility table only when it asks for something (or --check/--dry-run/-v); the
    changes a reshard makes are notes on stderr; -q prints nothing at all."""
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "a"), "--tp", "4"])
    assert res.exit_code == 0, res.output
    assert res.stdout == ""
    notes = [line for line in res.stderr.splitlines() if line.startswith("note: ")]
    assert any(line.startswith("note: rng_state: 4 rng_state objects") for line in notes)
    lines = res.stderr.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("resharded "))
    assert lines[verdict + 1:] and all(line.startswith(("resume with ", "  - "))
                                       for line in lines[verdict + 1:])  # how to resume, last
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "b"), "--tp", "4", "-q"])
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == "", res.output
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "c"), "--tp", "4", "-v"])
    assert res.exit_code == 0 and "feasibility" in res.stdout
    assert "target layout: tp4" in res.stdout and "note: " not in res.stderr


def test_an_infeasible_reshard_prints_each_error_once_with_its_fix(tmp_path):
    """What stops the reshard, one line each, the fix they share once, then the verdict; no
    layouts, no notes, no table (those with --verbose); -q prints the same lines."""
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "a"), "--tp", "3"])
    assert res.exit_code == 1 and res.stdout == ""
    lines = res.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 4 and len(set(errors)) == 4, lines
    assert lines.count("  fix: choose tp among 1, 2, 4") == 1, lines
    assert lines[-1].startswith("cannot reshard ") and "4 problems" in lines[-1]
    assert len(lines) == 6, lines  # 4 errors, their fix, the verdict
    assert not any(line.startswith("note: ") for line in lines)
    quiet = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "a"), "--tp", "3", "-q"])
    assert quiet.exit_code == 1 and quiet.stdout == "" and quiet.stderr == res.stderr
    res = runner.invoke(app, ["reshard", str(DIST), str(tmp_path / "a"), "--tp", "3", "-v"])
    assert res.exit_code == 1
    assert "feasibility" in res.stdout and "rng_state" in res.stdout  # the notes too
    res = runner.invoke(app, ["reshard", str(DIST), "--pp", "3", "--check"])
    lines = res.stderr.splitlines()
    assert res.exit_code == 1 and len(lines) == 3 and lines[1].startswith("  fix: "), lines
