"""metadata.json handling (CheckpointingConfig) and the package's public names."""

from __future__ import annotations

import json
import os

import pytest

from ckpt_tool.dist_checkpointing import core
from ckpt_tool.dist_checkpointing.core import (
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    maybe_load_config,
    save_config,
)
from ckpt_tool.errors import CkptError


def test_round_trip(tmp_path):
    save_config(CheckpointingConfig("torch_dist"), str(tmp_path))
    with open(tmp_path / "metadata.json") as f:
        assert json.load(f) == {
            "sharded_backend": "torch_dist",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
    assert maybe_load_config(str(tmp_path)) == CheckpointingConfig("torch_dist", 1, "torch", 1)
    assert maybe_load_config(tmp_path) == CheckpointingConfig("torch_dist")  # PathLike too
    assert check_is_distributed_checkpoint(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["metadata.json"]  # no temporary file left


def test_overwrite_is_atomic_replace(tmp_path):
    save_config(CheckpointingConfig("zarr"), str(tmp_path))
    save_config(CheckpointingConfig("torch_dist", 2), str(tmp_path))
    assert maybe_load_config(str(tmp_path)) == CheckpointingConfig("torch_dist", 2)
    assert sorted(os.listdir(tmp_path)) == ["metadata.json"]


def test_not_a_checkpoint(tmp_path):
    assert maybe_load_config(str(tmp_path)) is None
    assert maybe_load_config("") is None and maybe_load_config(None) is None
    assert not check_is_distributed_checkpoint(str(tmp_path / "missing"))


def test_bad_metadata_raises(tmp_path):
    (tmp_path / "metadata.json").write_text('{"unknown_field": 1}')
    with pytest.raises(TypeError):
        maybe_load_config(str(tmp_path))
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        maybe_load_config(str(tmp_path))


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        save_config(CheckpointingConfig("torch_dist"), str(tmp_path / "absent_dir"))
    assert os.listdir(tmp_path) == []


def test_exception_in_error_hierarchy():
    e = core.CheckpointingException("bad\n  sharding")
    assert isinstance(e, CkptError) and isinstance(e, Exception)
    assert str(e) == "bad sharding" and e.args == ("bad\n  sharding",)


def test_package_exports():
    import ckpt_tool.dist_checkpointing as dc

    for name in ("check_is_distributed_checkpoint", "ShardedTensor", "ShardedObject",
                 "LocalNonpersistentObject", "save", "load", "load_plain_tensors",
                 "load_tensors_metadata", "load_common_state_dict", "load_content_metadata",
                 "remove_sharded_tensors", "core", "mapping", "dict_utils", "utils",
                 "optimizer", "validation", "serialization"):
        assert hasattr(dc, name), name


@pytest.mark.interop
def test_reads_megatron_core_config(tmp_path):
    mcore = pytest.importorskip("megatron.core.dist_checkpointing.core")
    mcore.save_config(mcore.CheckpointingConfig("torch_dist"), str(tmp_path))
    assert maybe_load_config(str(tmp_path)) == CheckpointingConfig("torch_dist")
    other = tmp_path / "ours"
    other.mkdir()
    save_config(CheckpointingConfig("zarr", 1, "torch", 1), str(other))
    theirs = mcore.maybe_load_config(str(other))
    assert (theirs.sharded_backend, theirs.common_backend) == ("zarr", "torch")
    assert mcore.check_is_distributed_checkpoint(str(other))


@pytest.mark.interop
@pytest.mark.parametrize(
    "module", ["", ".core", ".mapping", ".dict_utils", ".utils", ".optimizer", ".validation"])
def test_same_public_names_as_megatron_core(module):
    """Every public function/class Megatron-Core defines in these modules exists here too."""
    import importlib
    import inspect

    theirs = pytest.importorskip(f"megatron.core.dist_checkpointing{module}")
    ours = importlib.import_module(f"ckpt_tool.dist_checkpointing{module}")
    wanted = {
        name for name, obj in vars(theirs).items()
        if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
        and (module == "" or obj.__module__ == theirs.__name__)
    }
    assert wanted, "nothing to compare"
    assert sorted(wanted - set(dir(ours))) == []
