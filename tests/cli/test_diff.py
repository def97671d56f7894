"""``ckpt diff``: exit codes (0 identical, 1 different, 2 unreadable), JSON document, tables."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpt_tool.cli.app import app

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32" / "iter_0000010"
LEGACY = FIXTURES / "megatron_legacy_tp2pp2"
DCP = FIXTURES / "dcp_plain"


def _json(*args):
    result = runner.invoke(app, ["diff", *map(str, args), "--json"])
    assert "Traceback" not in result.output, result.output
    doc = json.loads(result.stdout) if result.exit_code in (0, 1) else None
    return result, doc


@pytest.mark.parametrize("path", [MCORE, DCP, LEGACY])
def test_identical_exit_0(path):
    result, doc = _json(path, path)
    assert result.exit_code == 0, result.output
    assert doc["identical"] is True and doc["values"] == [] and doc["only_in_a"] == []
    assert result.stderr.strip().splitlines()[-1].startswith("identical:")


def test_legacy_vs_dist_exit_1():
    """The same model: the legacy side in Megatron-Core's names (a note says so), every tensor
    equal; the common states differ where the formats do, and the legacy side has the final
    norm's _extra_state object (a TENorm's where Transformer Engine is installed)."""
    result, doc = _json(LEGACY, MCORE)
    assert result.exit_code == 1
    assert doc["identical"] is False and doc["format_a"] == "legacy"
    assert doc["format_b"] == "torch_dist"
    assert doc["only_in_a"] == doc["only_in_b"] == []
    assert doc["values"] == [] and doc["stats"]["tensors_compared"] == 17
    assert doc["objects_only_in_a"] == ["decoder.final_layernorm._extra_state/shard_0_1"]
    assert doc["notes"][0].startswith("A (legacy) seen as Megatron-Core saves it")
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("DIFFERENT:") and "common-state differences" in line
    result, doc = _json(LEGACY, MCORE, "--filter", r"^(embedding|output_layer|decoder\.final)")
    assert result.exit_code == 1 and doc["stats"]["tensors_compared"] == 5
    assert doc["values"] == [] and doc["objects_only_in_a"] == [
        "decoder.final_layernorm._extra_state/shard_0_1"]


def _pair(tmp_path, change=None, dtype=None):
    g = torch.Generator().manual_seed(3)
    a = {"w": torch.randn(16, 8, generator=g), "x": torch.zeros(3)}
    b = {k: v.clone() for k, v in a.items()}
    if change:
        b["w"][change] += 0.25
    if dtype:
        b["w"] = b["w"].to(dtype)
    save_file(a, tmp_path / "a.safetensors")
    save_file(b, tmp_path / "b.safetensors")
    return tmp_path / "a.safetensors", tmp_path / "b.safetensors"


def test_value_difference_json_and_table(tmp_path):
    a, b = _pair(tmp_path, change=(9, 4))
    result, doc = _json(a, b)
    assert result.exit_code == 1
    (v,) = doc["values"]
    assert v["key"] == "w" and v["differing"] == 1 and v["first_index"] == [9, 4]
    assert v["max_abs_diff"] == pytest.approx(0.25, rel=1e-5)
    result = runner.invoke(app, ["diff", str(a), str(b)])
    assert result.exit_code == 1
    assert "different values" in result.stdout and "1 of 128" in result.stdout
    assert "1 tensor with different values" in result.stderr
    assert runner.invoke(app, ["diff", str(a), str(b), "--atol", "0.3"]).exit_code == 0


def test_dtype_change_and_tolerance(tmp_path):
    a, b = _pair(tmp_path, dtype=torch.bfloat16)
    result, doc = _json(a, b)
    assert result.exit_code == 1
    assert doc["dtype_changes"] == [{"key": "w", "a": "float32", "b": "bfloat16"}]
    result, doc = _json(a, b, "--rtol", "0.004")
    assert result.exit_code == 0 and doc["identical"] is True and doc["rtol"] == 0.004


def test_keys_only_on_corrupted_copy(tmp_path):
    copy = Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))
    for f in copy.glob("*.distcp"):
        f.write_bytes(b"\0" * f.stat().st_size)
    result, doc = _json(MCORE, copy, "--keys-only")
    assert result.exit_code == 0 and doc["keys_only"] is True
    result = runner.invoke(app, ["diff", str(MCORE), str(copy)])
    assert result.exit_code == 2 and result.stderr.startswith("ckpt: error:")


def test_rename(tmp_path):
    save_file({"module.w": torch.ones(2)}, tmp_path / "a.safetensors")
    save_file({"w": torch.ones(2)}, tmp_path / "b.safetensors")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert _json(a, b)[0].exit_code == 1
    result, doc = _json(a, b, "--rename", "module.=")
    assert result.exit_code == 0 and doc["only_in_a"] == []


@pytest.mark.parametrize("args", [
    ["missing_dir", str(DCP)],
    [str(DCP), str(DCP), "--rename", "nothing"],
    [str(DCP), str(DCP), "--filter", "("],
    [str(DCP), str(DCP), "--atol", "-1"],
])
def test_errors_exit_2(args):
    result = runner.invoke(app, ["diff", *args])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.path}",))


def test_crafted_common_state_is_refused(tmp_path):
    copy = Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))
    marker = tmp_path / "pwned"
    torch.save({"iteration": 10, "evil": _Touch(marker)}, copy / "common.pt")
    result = runner.invoke(app, ["diff", str(MCORE), str(copy)])
    assert result.exit_code == 2 and "--trust" in result.stderr and "common.pt" in result.stderr
    assert not marker.exists()


def test_identical_copy_is_compared_without_torch(tmp_path):
    copy = Path(shutil.copytree(MCORE, tmp_path / "iter_0000010"))
    code = ("import sys; from ckpt_tool.ops.diff import diff; "
            f"r = diff({str(MCORE)!r}, {str(copy)!r}); "
            "print(r.identical, r.stats['tensors_equal_bytes'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["True", "17", "False"]


def test_messages_are_plain_text(tmp_path):
    """The verdict is printed as is: brackets in it ('[keys only]', a directory named like a
    Rich tag) are not read as markup."""
    copy = Path(shutil.copytree(MCORE, tmp_path / "run[red]" / "iter_0000010"))
    result = runner.invoke(app, ["diff", "--keys-only", str(MCORE), str(copy)])
    assert result.exit_code == 0
    line = result.stderr.strip().splitlines()[-1]
    assert line.endswith("no differences [keys only]") and "run[red]" in line


def test_program_start_up_json_path():
    """As the ``ckpt`` program: ``--json`` output without Rich or torch imported; the
    start-up objects are frozen out of the GC, which runs again for the command."""
    code = ("import gc, runpy, sys\n"
            f"sys.argv = ['ckpt', 'diff', '--json', {str(MCORE)!r}, {str(MCORE)!r}]\n"
            "try:\n"
            "    runpy.run_module('ckpt_tool', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as e:\n"
            "    code = e.code\n"
            "print(code, 'rich' in sys.modules, 'torch' in sys.modules, gc.isenabled(),\n"
            "      gc.get_freeze_count() > 1000, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(out.stdout)["identical"] is True
    assert out.stderr.split()[-5:] == ["0", "False", "False", "True", "True"], out.stderr


def test_library_import_leaves_the_gc_alone():
    """This module imported the app (pytest is not the program): the GC was not touched."""
    import gc

    from ckpt_tool.cli import _startup

    assert gc.isenabled() and not _startup._paused[0]
    _startup.pause_gc()  # not the program (pytest is): nothing happens
    assert gc.isenabled() and not _startup._paused[0]


def test_the_verdict_survives_a_closed_pipe(tmp_path):
    """``ckpt diff A B | head -1``: the reader goes away; the exit code is still 1 (different)."""
    import shutil
    import subprocess
    import sys

    from ckpt_tool.formats import open_checkpoint

    src = Path(__file__).resolve().parents[2] / "fixtures" / "mcore016_gpt_tp2pp2_fp32"
    other = tmp_path / "b"
    shutil.copytree(src, other)
    chunk = open_checkpoint(other).metadata().tensors["output_layer.weight"].chunks[0]
    f = other / "iter_0000010" / chunk.file
    data = bytearray(f.read_bytes())
    data[chunk.byte_offset + chunk.byte_length // 2] ^= 1
    f.write_bytes(bytes(data))
    for args in ([], ["--json"]):
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_tool", "diff", str(src), str(other),
                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # before the command writes anything
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, (args, err.decode()[-500:])
        assert b"Traceback" not in err
