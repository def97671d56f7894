"""Safe ``.metadata`` reading: the torch path equals DCP's own reader, the light path is
torch-free and equivalent, MCore's pickled classes map to our stand-ins."""

import dataclasses
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from _builders import MCORE_TORCH, fake_module, split_grid, write_dcp
from ckpt_tool.errors import CorruptCheckpointError, InputError, UnsafePickleError
from ckpt_tool.formats.containers.dcp.dcp_metadata import (dcp_tensor_metas, read_dcp_metadata,
                                                           read_dcp_metadata_torch_free)


@pytest.fixture
def dcp_dir(tmp_path):
    w = torch.arange(24.0).reshape(4, 6)
    write_dcp(tmp_path / "ck", {
        "w": ((4, 6), split_grid(w, (2, 3))),
        "b": ((5,), [((0,), torch.ones(5, dtype=torch.bfloat16))]),
    }, {"rng_state/shard_0.1_1.2": {"seed": 1}})
    return tmp_path / "ck"


def test_torch_path_equals_filesystem_reader(dcp_dir):
    ours = read_dcp_metadata(dcp_dir)
    theirs = FileSystemReader(str(dcp_dir)).read_metadata()
    assert isinstance(ours, Metadata)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_light_path_maps_to_the_same_model(dcp_dir):
    t_heavy, o_heavy = dcp_tensor_metas(read_dcp_metadata(dcp_dir))
    t_light, o_light = dcp_tensor_metas(read_dcp_metadata_torch_free(dcp_dir))
    assert t_heavy == t_light and o_heavy == o_light
    w = t_light["w"]
    assert w.dtype == "float32" and w.shape == (4, 6) and len(w.chunks) == 6
    assert {c.offsets for c in w.chunks} == {(i, j) for i in (0, 2) for j in (0, 2, 4)}
    assert all(c.file.endswith(".distcp") and c.byte_length > 0 for c in w.chunks)
    assert t_light["b"].dtype == "bfloat16"
    (obj,) = o_light
    assert (obj.key, obj.global_offset, obj.global_shape) == ("rng_state", (0, 1), (1, 2))


def test_light_path_imports_no_torch(dcp_dir):
    code = ("import sys; from ckpt_tool.formats.containers.dcp.dcp_metadata import read_dcp_metadata_torch_free, "
            f"dcp_tensor_metas; t, o = dcp_tensor_metas(read_dcp_metadata_torch_free({str(dcp_dir)!r}));"
            " assert t['w'].shape == (4, 6); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@dataclasses.dataclass
class MCoreMetadata(Metadata):
    mcore_data: Any = None


@dataclasses.dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    mcore_data: Any = None


def test_mcore_classes_become_our_subclasses(tmp_path):
    mcore_data = {"opt": {"nd_reformulated_orig_global_shape": (4, 6)}}
    stored = torch.arange(24.0).reshape(2, 2, 6)
    with fake_module(MCORE_TORCH, MCoreMetadata=MCoreMetadata, MCoreSavePlan=MCoreSavePlan):
        md = write_dcp(tmp_path, {"opt": ((2, 2, 6), [((i, j, 0), stored[i:i + 1, j:j + 1])
                                                       for i in range(2) for j in range(2)])},
                       mcore_data=mcore_data, metadata_cls=MCoreMetadata)
        md.all_local_plans = [MCoreSavePlan(items=[], mcore_data=mcore_data)]
        (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    megatron_before = {m for m in sys.modules if m.startswith("megatron")}
    heavy = read_dcp_metadata(tmp_path)
    assert isinstance(heavy, Metadata) and type(heavy).__name__ == "MCoreMetadata"
    assert heavy.mcore_data == mcore_data
    assert isinstance(heavy.all_local_plans[0], SavePlan)
    assert heavy.all_local_plans[0].mcore_data == mcore_data
    light = read_dcp_metadata_torch_free(tmp_path)
    assert light.mcore_data == mcore_data
    tensors, _ = dcp_tensor_metas(light)
    assert tensors["opt"].shape == (4, 6) and tensors["opt"].stored_shape == (2, 2, 6)
    assert all(c.layout == "flat" for c in tensors["opt"].chunks)
    assert {m for m in sys.modules if m.startswith("megatron")} == megatron_before


def test_per_rank_metadata_file(dcp_dir):
    (dcp_dir / ".metadata").rename(dcp_dir / "__0.metadata")
    assert read_dcp_metadata(dcp_dir, rank=0).state_dict_metadata.keys() == {
        "w", "b", "rng_state/shard_0.1_1.2"}
    assert "w" in read_dcp_metadata_torch_free(dcp_dir).state_dict_metadata


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"trunc"])
def test_bad_metadata_files(dcp_dir, content):
    md = dcp_dir / ".metadata"
    md.write_bytes(md.read_bytes()[:200] if content == b"trunc" else content)
    for read in (read_dcp_metadata, read_dcp_metadata_torch_free):
        with pytest.raises(CorruptCheckpointError) as e:
            read(dcp_dir)
        assert ".metadata" in str(e.value)


def test_metadata_of_wrong_type(dcp_dir):
    (dcp_dir / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    for read in (read_dcp_metadata, read_dcp_metadata_torch_free):
        with pytest.raises(CorruptCheckpointError, match="does not hold DCP Metadata"):
            read(dcp_dir)


def test_missing_metadata_and_unsafe_global(dcp_dir, tmp_path):
    with pytest.raises(InputError):
        read_dcp_metadata(tmp_path / "nope")
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(subprocess.Popen))
    for read in (read_dcp_metadata, read_dcp_metadata_torch_free):
        with pytest.raises(UnsafePickleError, match="subprocess.Popen"):
            read(dcp_dir)
