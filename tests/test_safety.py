"""No code from a checkpoint runs unless --trust: crafted pickles that would create a file are
refused (by name, exit 2) in ``.metadata``, ``common.pt`` and ShardedObject payloads."""

import builtins
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent / "formats"))
from _builders import write_mcore_dist  # noqa: E402

from ckpt_tool.cli.app import app  # noqa: E402
from ckpt_tool.errors import UnsafePickleError  # noqa: E402
from ckpt_tool.formats import open_checkpoint  # noqa: E402
from ckpt_tool.formats.common_state import load_torch_free  # noqa: E402
from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata, read_dcp_metadata_torch_free  # noqa: E402
from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file, safe_loads  # noqa: E402

runner = CliRunner()


class _Reduce:
    """Pickles as ``func(*args)``."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def _payloads(marker: Path):
    return {
        "os.system": _Reduce(os.system, f"touch {marker}"),
        "builtins.open": _Reduce(builtins.open, str(marker), "w"),
        "builtins.exec": _Reduce(exec, f"open({str(marker)!r}, 'w')"),
        "subprocess.Popen": _Reduce(subprocess.Popen, ["touch", str(marker)]),
        "builtins.eval": _Reduce(eval, f"open({str(marker)!r}, 'w')"),
    }


def _names(marker):
    return list(_payloads(marker))


@pytest.fixture
def ckpt(tmp_path):
    return write_mcore_dist(tmp_path / "ck", {"w": ((2,), [((0,), torch.ones(2))])},
                            {"rng_state/shard_0_1": {"seed": 1}}, common={"iteration": 1})


def _expected_global(name: str) -> str:
    return {"os.system": "posix.system", "builtins.open": "io.open"}.get(name, name)


@pytest.mark.parametrize("name", _names(Path("x")))
def test_evil_metadata_never_runs(ckpt, tmp_path, name):
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps({"x": [_payloads(marker)[name]]}))
    for read in (read_dcp_metadata, read_dcp_metadata_torch_free):
        with pytest.raises(UnsafePickleError, match=_expected_global(name)):
            read(ckpt)
    for args in (["inspect", str(ckpt)], ["inspect", str(ckpt), "--json"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert _expected_global(name) in result.output and "--trust" in result.output
    assert not marker.exists()


@pytest.mark.parametrize("name", _names(Path("x")))
def test_evil_common_pt_never_runs(ckpt, tmp_path, name):
    marker = tmp_path / "pwned"
    torch.save({"iteration": 1, "args": _payloads(marker)[name]}, ckpt / "common.pt")
    for load in (load_torch_file, load_torch_free):
        with pytest.raises(UnsafePickleError, match=_expected_global(name)):
            load(ckpt / "common.pt")
    with pytest.raises(UnsafePickleError):
        open_checkpoint(ckpt).common()
    result = runner.invoke(app, ["inspect", str(ckpt), "--json"])
    assert result.exit_code == 2 and _expected_global(name) in result.output
    assert not marker.exists()


def test_evil_sharded_object_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    ck = write_mcore_dist(tmp_path / "ck", {"w": ((2,), [((0,), torch.ones(2))])},
                          {"rng_state/shard_0_1": _Reduce(os.system, f"touch {marker}")},
                          common={"iteration": 1})
    assert runner.invoke(app, ["inspect", str(ck)]).exit_code == 0  # metadata only: not unpickled
    with pytest.raises(UnsafePickleError, match="posix.system"):
        open_checkpoint(ck).read_object("rng_state/shard_0_1")
    assert not marker.exists()


def test_megatron_globals_become_inert_stand_ins(tmp_path):
    marker = tmp_path / "pwned"
    before = {m for m in sys.modules if m.startswith("megatron")}
    data = f"cmegatron.core.training.utils\nrun_cmd\n(S'touch {marker}'\ntR.".encode()
    obj = safe_loads(data)
    assert obj.fields()["_args"] == (f"touch {marker}",)
    assert "megatron.core.training.utils.run_cmd" in repr(obj)
    assert {m for m in sys.modules if m.startswith("megatron")} == before
    assert not marker.exists()


def test_cli_subprocess_no_code_runs(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Reduce(os.system, f"touch {marker}")))
    proc = subprocess.run([sys.executable, "-m", "ckpt_tool", "inspect", str(ckpt)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "posix.system" in proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()
