"""``ckpt convert`` through the CLI: exit codes, JSON summary, refusals, a killed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

runner = CliRunner()
FIX = Path(__file__).resolve().parents[2] / "fixtures"
LEGACY = FIX / "megatron_legacy_tp2pp2"


def test_json_summary_and_notes(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "legacy", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["format"] == "legacy" and doc["source_format"] == "legacy"
    assert doc["tensors"] == 53 and doc["verified"] is True and doc["nbytes"] > 0
    assert (out / "latest_checkpointed_iteration.txt").exists()


def test_the_summary_counts_what_was_written(tmp_path):
    """Objects the target has no place for (safetensors, torch) and optimizer tensors legacy
    files leave out are not counted as written."""
    src = FIX / "mcore016_gpt_tp2pp2_bf16_optim"  # 64 tensors (48 optimizer), 20 objects
    for to, dst, tensors, objects in (("safetensors", "st", 64, 0), ("torch", "m.pt", 64, 0),
                                      ("legacy", "leg", 16, 20), ("torch_dist", "td", 64, 20)):
        result = runner.invoke(app, ["convert", str(src), str(tmp_path / dst), "--to", to,
                                     "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert (doc["tensors"], doc["objects"]) == (tensors, objects), to
        summary = next(x for x in result.stderr.splitlines() if x.startswith("converted "))
        assert f"{tensors} tensors, {objects} objects" in summary


def test_refuses_existing_output_and_output_inside_source(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "legacy"])
    assert result.exit_code == 2 and "already exists" in result.stderr
    assert "--overwrite" in result.stderr and "Traceback" not in result.output
    result = runner.invoke(app, ["convert", str(LEGACY), str(LEGACY / "x"), "--to", "legacy"])
    assert result.exit_code == 2 and "inside the input" in result.stderr
    assert not (LEGACY / "x").exists()


def test_overwrite_replaces(tmp_path):
    out = tmp_path / "out"
    first = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "safetensors"])
    assert first.exit_code == 0, first.output
    (out / "junk").write_text("x")  # a checkpoint with something more in it: still one
    result = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "legacy",
                                 "--overwrite"])
    assert result.exit_code == 0, result.output
    assert not (out / "junk").exists() and (out / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_overwrite_refuses_what_is_not_a_checkpoint(tmp_path, kind):
    """A directory of someone's files (or a plain file) is not replaced: one line naming it."""
    out = tmp_path / "out"
    if kind == "directory":
        (out / "code").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        (out / "code" / "train.py").write_text("print()")
    else:
        out.write_text("mine")
    result = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "legacy",
                                 "--overwrite"])
    assert result.exit_code == 2, result.output
    assert "--overwrite replaces only a checkpoint" in result.stderr
    if kind == "directory":
        assert "notes.txt" in result.stderr
        assert (out / "notes.txt").read_text() == "mine"
        assert (out / "code" / "train.py").read_text() == "print()"
    else:
        assert out.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_fills_an_empty_directory(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = runner.invoke(app, ["convert", str(LEGACY), str(out), "--to", "legacy",
                                 "--overwrite"])
    assert result.exit_code == 0, result.output


def test_usage_errors_exit_2(tmp_path):
    for extra in (["--to", "onnx"], ["--to", "legacy", "--dtype", "int3"],
                  ["--to", "legacy", "--max-memory", "lots"],
                  ["--to", "legacy", "--rename", "nope"],
                  ["--to", "legacy", "--tp", "4"]):
        result = runner.invoke(app, ["convert", str(LEGACY), str(tmp_path / "o"), *extra])
        assert result.exit_code == 2, (extra, result.output)
        assert result.stderr.startswith("ckpt: error:") and "Traceback" not in result.output
    assert os.listdir(tmp_path) == []


def test_unreadable_source_exit_2(tmp_path):
    result = runner.invoke(app, ["convert", str(tmp_path / "missing"), str(tmp_path / "o"),
                                 "--to", "legacy"])
    assert result.exit_code == 2 and "no such file" in result.stderr


KILLER = """
import os, signal, sys
from ckpt_tool.ops import _source
real = _source.ReaderSource.read
def read(self, *a, **k):
    if self.pieces == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(self, *a, **k)
_source.ReaderSource.read = read
from ckpt_tool.cli.app import app
sys.argv = ["ckpt", "convert", sys.argv[1], sys.argv[2], "--to", "legacy"]
app()
"""


def test_killed_conversion_leaves_nothing_that_looks_complete(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(LEGACY), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    leftovers = [n for n in os.listdir(tmp_path) if not n.endswith(".ckpt-lock")]
    assert len(leftovers) == 1 and ".ckpt-staging-" in leftovers[0]  # (+ the dead run's lock)
    # the source is untouched and still valid
    result = runner.invoke(app, ["validate", str(LEGACY)])
    assert result.exit_code == 0


def test_workers_write_in_parallel_with_the_same_result(tmp_path):
    optim = FIX / "mcore016_gpt_tp2pp2_bf16_optim"
    result = runner.invoke(app, ["convert", str(optim), str(tmp_path / "w"), "--to",
                                 "torch_dist", "--workers", "2", "--json"])
    assert result.exit_code == 0, result.output
    same = runner.invoke(app, ["diff", str(optim), str(tmp_path / "w"), "--json"])
    assert same.exit_code == 0, same.output
    assert json.loads(same.stdout)["stats"]["tensors_compared"] == 64


MCORE = FIX / "mcore016_gpt_tp2pp2_fp32"


def test_single_file_targets_are_written_where_named_and_read_back(tmp_path):
    out = tmp_path / "m.safetensors"
    result = runner.invoke(app, ["convert", str(MCORE), str(out), "--to", "safetensors"])
    assert result.exit_code == 0, result.output
    assert out.is_file()  # not a directory named m.safetensors
    out_pt = tmp_path / "m.pt"
    assert runner.invoke(app, ["convert", str(MCORE), str(out_pt), "--to", "torch"]).exit_code == 0
    assert out_pt.is_file()
    for path in (out, out_pt):
        for argv in (["inspect", str(path)], ["validate", str(path)]):
            assert runner.invoke(app, argv).exit_code == 0, argv
    result = runner.invoke(app, ["diff", str(out), str(out_pt)])
    assert result.exit_code == 0, result.output


def test_a_directory_target_is_read_back_by_every_command(tmp_path):
    out = tmp_path / "x"  # no file suffix: a directory holding model.pt
    assert runner.invoke(app, ["convert", str(MCORE), str(out), "--to", "torch"]).exit_code == 0
    assert (out / "model.pt").is_file()
    for argv in (["inspect", str(out)], ["validate", str(out)],
                 ["diff", str(out), str(out / "model.pt")]):
        result = runner.invoke(app, argv)
        assert result.exit_code == 0, (argv, result.output)


def test_one_safetensors_file_with_shards_asked_is_one_line_exit_2(tmp_path):
    out = tmp_path / "m.safetensors"
    result = runner.invoke(app, ["convert", str(MCORE), str(out), "--to", "safetensors",
                                 "--max-shard-size", "1000"])
    assert result.exit_code == 2 and "names one safetensors file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_an_export_the_weights_do_not_fit_names_the_architecture_not_a_config(tmp_path):
    """No config.json was given: the error names the architecture the args picked and the
    options that change it, never "fix config.json"."""
    src = FIX / "mcore016_moe_ep2_distopt_buckets"  # a shared expert without its gate
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 2 and not (tmp_path / "hf").exists()
    [line] = result.stderr.splitlines()
    assert "the weights do not fit Qwen2MoeForCausalLM as the checkpoint's args describe " \
           "them: no mlp.shared_experts.gate_weight for layer 0" in line
    assert "--hf-arch" in line and "config.json" not in line


def test_key_selection_is_refused_for_an_hf_conversion(tmp_path):
    """--exclude 'bias$' used to be ignored silently (the same refusal as without it)."""
    src = FIX / "mcore016_gpt_tp2pp2_bf16_optim"
    result = runner.invoke(app, ["convert", str(src), str(tmp_path / "hf"), "--to", "hf",
                                 "--exclude", "bias$"])
    assert result.exit_code == 2 and not (tmp_path / "hf").exists()
    [line] = result.stderr.splitlines()
    assert "--filter, --exclude and --rename do not apply to an HF conversion" in line
