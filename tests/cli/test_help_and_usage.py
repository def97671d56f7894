"""Help fits 80 columns (whole flag names, whole sentences), usage errors are one line, and
counts read "1 finding", "1 tensor", "1 file"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
COMMANDS = ["inspect", "validate", "reshard", "convert", "diff"]


def _ckpt(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "ckpt_tool", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=120)


def test_reshard_help_at_80_columns():
    proc = _ckpt("reshard", "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Usage: ckpt reshard [OPTIONS]")
    assert max(map(len, lines)) <= 80
    for flag in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                 "--make-vocab-size-divisible-by", "--local-spec / --te-spec", "--drop-optimizer",
                 "--ddp-bucket-size N"):
        assert flag in proc.stdout
    # the descriptions are wrapped, never cut off
    assert "…" not in proc.stdout and "checkpoint's configuration)." in proc.stdout
    assert "pre_mlp_layernorm.* or the fused ones)" in " ".join(proc.stdout.split())
    assert "--to FORMAT" in proc.stdout and "torch_dist or legacy" in proc.stdout


@pytest.mark.parametrize("name", ["", *COMMANDS])
def test_every_help_fits_80_columns_with_whole_flags_and_sentences(name):
    argv = [name, "--help"] if name else ["--help"]
    result = runner.invoke(app, argv, env={"COLUMNS": "80"})
    assert result.exit_code == 0
    text = result.stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert "…" not in text and "╭" not in text
    # no sentence cut off ("..."), no word (a flag name above all) split at a hyphen
    assert not [ln for ln in lines if ln.rstrip().endswith("...") and "Usage:" not in ln]
    assert not [ln for ln in lines if re.search(r"\w-$", ln)]
    group = typer.main.get_command(app)
    cmd = group.commands[name] if name else group
    for param in cmd.params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert re.search(rf"(^|[\s,/]){re.escape(opt)}(\s|,|$)", text, re.M), opt


def test_commands_list_shows_whole_sentences():
    text = runner.invoke(app, ["--help"], env={"COLUMNS": "80"}).stdout
    rows = [ln.split(None, 1) for ln in text.split("Commands:")[1].splitlines() if ln.strip()]
    assert [r[0] for r in rows] == COMMANDS
    assert all(r[1].endswith(".") and not r[1].endswith("...") for r in rows)


def test_convert_to_lists_every_target_format():
    from ckpt_tool.formats.writer import WRITERS

    text = " ".join(runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "80"})
                    .stdout.split())
    listed = text.split("--to FORMAT")[1].split("[required]")[0]
    for name in WRITERS:
        assert re.search(rf"\b{name}\b", listed), name


@pytest.mark.parametrize("command", COMMANDS)
def test_examples_heading_counts_the_examples(command):
    text = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}).stdout
    heading = "Examples:" if "Examples:" in text else "Example:"
    block = text.split(heading)[1].split("\n\n")[0]
    examples = [ln for ln in block.splitlines() if ln.strip().startswith("ckpt ")]
    assert heading == ("Examples:" if len(examples) > 1 else "Example:"), text


def test_convert_dst_names_both_single_file_targets():
    text = " ".join(runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "80"})
                    .stdout.split())
    dst = text.split("Arguments:")[1].split(" DST ")[1].split("[required]")[0]
    assert ".safetensors" in dst and ".pt" in dst, dst


@pytest.mark.parametrize("argv, line", [
    (["convert", "--frob"], "no such option: --frob (try 'ckpt convert --help')"),
    (["convert", "a", "b", "--frob"], "no such option: --frob (try 'ckpt convert --help')"),
    (["reshard", "a", "--dry_run"],
     "no such option: --dry_run; did you mean --dry-run? (try 'ckpt reshard --help')"),
    (["frob"], "no such command 'frob' (try 'ckpt --help')"),
    (["--frob"], "no such option: --frob (try 'ckpt --help')"),
    (["convert", "a", "b"], "missing option '--to' (try 'ckpt convert --help')"),
    (["validate"], "missing argument 'PATH' (try 'ckpt validate --help')"),
    (["reshard", "a", "--tp", "0"],
     "invalid value for '--tp': 0 is not in the range x>=1 (try 'ckpt reshard --help')"),
    (["diff", "a", "b", "--atol", "big"],
     "invalid value for '--atol': 'big' is not a valid float range (try 'ckpt diff --help')"),
])
def test_usage_errors_are_one_line_exit_2(argv, line):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == f"ckpt: error: {line}\n"


def test_usage_error_through_the_program():
    proc = _ckpt("convert", "--frob")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "ckpt: error: no such option: --frob (try 'ckpt convert --help')\n"


def test_no_arguments_shows_the_help_on_stderr():
    result = runner.invoke(app, [])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("Usage: ckpt [OPTIONS] COMMAND")
    assert "Commands:" in result.stderr


# -- plurals ---------------------------------------------------------------------------------

@pytest.fixture
def one_tensor(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp_api

    w = torch.zeros(4)
    w[1] = float("nan")
    dcp_api.save({"w": w}, checkpoint_id=tmp_path / "one", no_dist=True)
    return tmp_path / "one"


def test_one_finding_one_tensor_one_file(one_tensor):
    result = runner.invoke(app, ["validate", str(one_tensor), "--deep"])
    assert result.exit_code == 0
    assert "1 finding\n" in result.stdout or result.stdout.lstrip().startswith("1 finding")
    assert "1 findings" not in result.stdout
    verdict = result.stderr.strip().splitlines()[-1]
    assert "0 errors, 1 warning [" in verdict
    assert "1 tensor, " in verdict and "1 file, " in verdict and "1 tensor read" in verdict
    assert not re.search(r"\b1 (tensors|files|findings|warnings|zip items)\b", verdict)
    out = runner.invoke(app, ["inspect", str(one_tensor)]).stdout
    assert re.search(r"^1 tensor$", out, re.M), out
    assert "1 tensors" not in out


def test_one_nan_element_and_one_tensor_converted(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.tensor([float("nan")])}, tmp_path / "one.safetensors")
    result = runner.invoke(app, ["validate", str(tmp_path / "one.safetensors"), "--deep",
                                 "--json"])
    assert json.loads(result.stdout)["findings"][0]["message"] == "1 NaN and 0 Inf of 1 element"
    result = runner.invoke(app, ["convert", str(tmp_path / "one.safetensors"),
                                 str(tmp_path / "out"), "--to", "dcp"])
    assert result.exit_code == 0, result.output
    assert ": 1 tensor, 0 objects, " in result.stderr


def test_one_tensor_with_different_values(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(3)}, tmp_path / "b.safetensors")
    result = runner.invoke(app, ["diff", str(tmp_path / "a.safetensors"),
                                 str(tmp_path / "b.safetensors")])
    assert result.exit_code == 1
    assert "1 tensor with different values" in result.stderr
    assert "1 of 1 common tensor compared" in result.stderr
