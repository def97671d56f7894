"""Tests of the zarr backend strategies (Megatron-Core's removed ``zarr`` on-disk layout)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

zarr_strategies = pytest.importorskip("ckpt_tool.dist_checkpointing.strategies.zarr")
ZarrLoadShardedStrategy = zarr_strategies.ZarrLoadShardedStrategy
ZarrSaveShardedStrategy = zarr_strategies.ZarrSaveShardedStrategy

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "_workers" / "zarr_worker.py"


def _worker_module():
    spec = importlib.util.spec_from_file_location("zarr_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ts_read(array_dir) -> np.ndarray:
    import tensorstore as ts

    spec = {"driver": "zarr", "metadata_key": ".zarray",
            "kvstore": {"driver": "file", "path": str(array_dir)}}
    return ts.open(spec, open=True).result().read().result()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _save(sd, ckpt):
    ZarrSaveShardedStrategy("zarr", 1).save(sd, ckpt)


def _request(key, shape, dtype, *rank_offsets, **kw):
    return ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype), *rank_offsets, **kw)


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(6, 4, generator=g),
        "bf16": torch.randn(4, 6, generator=g).bfloat16(),
        "i64": torch.randint(-(2**50), 2**50, (3, 5), generator=g),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
    }


@pytest.fixture
def ckpt(tmp_path, tensors):
    _save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, tmp_path)
    return tmp_path


def test_round_trip_at_other_sharding(ckpt, tensors):
    request = {
        "fp32": _request("fp32", (3, 4), torch.float32, (0, 1, 2)),
        "bf16": _request("bf16", (2, 3), torch.bfloat16, (0, 1, 2), (1, 0, 2)),
        "i64": _request("i64", (3, 5), torch.int64),
        "mask": _request("mask", (4, 2), torch.bool, (1, 1, 2)),
    }
    out = ZarrLoadShardedStrategy().load(request, ckpt)
    assert torch.equal(out["fp32"], tensors["fp32"][3:])
    assert out["bf16"].dtype == torch.bfloat16
    assert torch.equal(_bits(out["bf16"]), _bits(tensors["bf16"][2:, :3]))
    assert torch.equal(out["i64"], tensors["i64"])
    assert torch.equal(out["mask"], tensors["mask"][:, 2:])


def test_layout_and_bf16_header(ckpt, tensors):
    header = json.loads((ckpt / "bf16" / ".zarray").read_text())
    assert header["dtype"] == "bfloat16"
    assert header["compressor"] is None and header["filters"] is None
    assert header["zarr_format"] == 2 and header["order"] == "C"
    assert header["shape"] == [4, 6] and header["chunks"] == [4, 6]
    raw = (ckpt / "bf16" / "0.0").read_bytes()  # one chunk, raw little-endian 2-byte values
    assert raw == tensors["bf16"].view(torch.int16).numpy().astype("<i2").tobytes()
    assert json.loads((ckpt / "fp32" / ".zarray").read_text())["dtype"] == "<f4"
    assert json.loads((ckpt / "i64" / ".zarray").read_text())["dtype"] == "<i8"


def test_tensorstore_and_zarr_python_read_our_arrays(ckpt, tensors):
    import ml_dtypes
    import zarr

    for key, ref in tensors.items():
        got = _ts_read(ckpt / key)
        if ref.dtype == torch.bfloat16:
            assert got.dtype == np.dtype(ml_dtypes.bfloat16)
            assert np.array_equal(got.view(np.int16), ref.view(torch.int16).numpy())
        else:
            assert np.array_equal(got, ref.numpy())
    # zarr-python (2 or 3: ckpt_tool does not use it, it is an independent reader here) reads
    # every array; the "bfloat16" dtype name only zarr-python 2 knows (docs/formats.md s. 2)
    zarr2 = zarr.__version__.startswith("2.")
    for key, ref in tensors.items():
        if ref.dtype == torch.bfloat16 and not zarr2:
            continue
        z = zarr.open_array(str(ckpt / key), mode="r")
        got = z[...]
        if ref.dtype == torch.bfloat16:
            assert np.array_equal(got.view(np.int16), ref.view(torch.int16).numpy())
        else:
            assert got.dtype == ref.numpy().dtype and np.array_equal(got, ref.numpy()), key


def test_prepend_axis_chunks(tmp_path):
    layers = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    sd = [ShardedTensor.from_rank_offsets("stk", layers[0], (0, 0, 2), prepend_axis_num=1)]
    _save(sd, tmp_path)
    assert json.loads((tmp_path / "stk" / ".zarray").read_text())["chunks"] == [1, 3, 4]
    assert sorted(os.listdir(tmp_path / "stk")) == [".zarray", "0.0.0"]
    req = [_request("stk", (3, 4), torch.float32, (0, 0, 2), prepend_axis_num=1)]
    assert torch.equal(ZarrLoadShardedStrategy().load(req, tmp_path)[0], layers[0])


def test_tensors_metadata_skips_sync_and_objects(ckpt, tensors):
    (ckpt / "flat.sync").mkdir()
    (ckpt / "rng_state").mkdir()
    torch.save({"x": 1}, ckpt / "rng_state" / "shard_0_1.pt")
    meta = ZarrLoadShardedStrategy().load_tensors_metadata(ckpt)
    assert set(meta) == set(tensors)
    for key, ref in tensors.items():
        assert meta[key].key == key and meta[key].data is None
        assert meta[key].dtype == ref.dtype
        assert tuple(meta[key].global_shape) == tuple(ref.shape)
        assert tuple(meta[key].local_shape) == tuple(ref.shape)
    # a metadata dict is itself a valid load request for whole tensors
    for key, st in meta.items():
        st.data = torch.empty(st.local_shape, dtype=st.dtype)
    out = ZarrLoadShardedStrategy().load(meta, ckpt)
    assert all(torch.equal(_bits(out[k]), _bits(v)) for k, v in tensors.items())


def test_shape_mismatch(ckpt, tensors):
    bad = {"fp32": _request("fp32", (8, 4), torch.float32)}
    with pytest.raises(CheckpointingException, match="Global shape mismatch"):
        ZarrLoadShardedStrategy().load(bad, ckpt)
    # padded vocab: a larger requested global shape is read clipped and zero-padded
    req = {"fp32": _request("fp32", (4, 4), torch.float32, (0, 1, 2), allow_shape_mismatch=True)}
    req["fp32"].global_shape = (8, 4)
    out = ZarrLoadShardedStrategy().load(req, ckpt)["fp32"]
    assert torch.equal(out[:2], tensors["fp32"][4:]) and not out[2:].any()


def test_missing_array_and_existing_array(ckpt):
    with pytest.raises(CheckpointingException, match="not found"):
        ZarrLoadShardedStrategy().load({"x": _request("nope", (2,), torch.float32)}, ckpt)
    with pytest.raises(CheckpointingException, match="already exists"):
        _save({"fp32": ShardedTensor.from_rank_offsets("fp32", torch.zeros(6, 4))}, ckpt)


def test_unsupported_dtype(tmp_path):
    with pytest.raises(CheckpointingException, match="cannot be stored"):
        _save({"u": ShardedTensor.from_rank_offsets("u", torch.zeros(2, dtype=torch.uint32))}, tmp_path)


def test_compatibility_checks():
    strategy = ZarrLoadShardedStrategy()
    strategy.check_backend_compatibility("zarr")
    strategy.check_version_compatibility(1)
    with pytest.raises(CheckpointingException):
        strategy.check_backend_compatibility("torch_dist")
    with pytest.raises(CheckpointingException):
        strategy.check_version_compatibility(2)
    assert not strategy.can_handle_sharded_objects


def test_remove_sharded_tensors(ckpt):
    (ckpt / "fp32.sync").mkdir()
    ZarrLoadShardedStrategy().remove_sharded_tensors(ckpt, "fp")
    assert not (ckpt / "fp32").exists() and not (ckpt / "fp32.sync").exists()
    assert set(ZarrLoadShardedStrategy().load_tensors_metadata(ckpt)) == {"bf16", "i64", "mask"}


def test_registered_as_zarr_default():
    base = pytest.importorskip("ckpt_tool.dist_checkpointing.strategies.base")
    save = base.get_default_strategy(base.StrategyAction.SAVE_SHARDED, "zarr", 1)
    load = base.get_default_strategy(base.StrategyAction.LOAD_SHARDED, "zarr", 1)
    assert isinstance(save, ZarrSaveShardedStrategy)
    assert isinstance(load, ZarrLoadShardedStrategy)
    assert (save.backend, save.version) == ("zarr", 1)


# ---------------------------------------------------------------- multi-process (torchrun/gloo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, timeout: float = 300, check: bool = True):
    """Run the zarr worker under torchrun with ``nproc`` gloo ranks; return its stdout
    (the CompletedProcess when ``check`` is False)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(WORKER), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if not check:
        return proc
    if proc.returncode != 0:
        rank_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank")]
        pytest.fail("torchrun failed:\n" + "\n".join(rank_lines[-60:]) + proc.stderr[-3000:])
    return proc.stdout


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("zarr4")
    torchrun(4, "save", str(ckpt))
    return ckpt


@pytest.mark.multiproc
def test_multirank_save_layout(saved4):
    ref = _worker_module().global_tensors()
    header = json.loads((saved4 / "grid.bf16" / ".zarray").read_text())
    assert header["dtype"] == "bfloat16" and header["chunks"] == [2, 4]
    assert sorted(os.listdir(saved4 / "grid.bf16")) == [".zarray", "0.0", "0.1", "1.0", "1.1"]
    assert json.loads((saved4 / "rows.weight" / ".zarray").read_text())["chunks"] == [2, 6]
    assert (saved4 / "flat.exp_avg.sync").is_dir()  # synchronizer dir, as Megatron-Core left it
    for key, expected in ref.items():
        raw = _ts_read(saved4 / key)
        assert np.array_equal(raw.reshape(-1).view(np.uint8), _bits(expected).numpy()), key
    meta = ZarrLoadShardedStrategy().load_tensors_metadata(saved4)
    assert set(meta) == set(ref)
    assert all(meta[k].dtype == v.dtype and tuple(meta[k].global_shape) == v.shape
               for k, v in ref.items())


@pytest.mark.multiproc
def test_multirank_load_at_other_world_sizes(saved4):
    worker = _worker_module()
    for world in (2, 1):  # 2 ranks under torchrun; 1 = this process, no process group
        if world == 2:
            assert "OK load world=2" in torchrun(2, "load", str(saved4))
            continue
        request = worker.sharded_state_dict(0, 1, with_data=False)
        loaded = ZarrLoadShardedStrategy().load(request, saved4)
        ref = worker.global_tensors()
        assert torch.equal(_bits(loaded["rows"]), _bits(ref["rows.weight"]))
        assert torch.equal(_bits(loaded["grid"]), _bits(ref["grid.bf16"]))
        assert torch.equal(loaded["ids"], ref["ids"])
        assert all(torch.equal(_bits(t), _bits(ref["stacked"][i]))
                   for i, t in enumerate(loaded["stacked"]))


@pytest.mark.multiproc
def test_multirank_error_on_one_rank_fails_all_without_hanging(tmp_path):
    proc = torchrun(2, "save-bad", str(tmp_path), check=False)
    assert proc.returncode != 0
    assert "rank 0 raised: zarr save failed while writing chunks on rank 1" in proc.stdout
    assert "rank 1 raised: Array" in proc.stdout and "no rank did" in proc.stdout


@pytest.mark.multiproc
def test_public_api_save_load_with_objects(tmp_path):
    dc = pytest.importorskip("ckpt_tool.dist_checkpointing")
    if not hasattr(dc, "save"):
        pytest.skip("ckpt_tool.dist_checkpointing.serialization is not available yet")
    torchrun(2, "api-save", str(tmp_path))
    config = json.loads((tmp_path / "metadata.json").read_text())
    assert config["sharded_backend"] == "zarr" and config["sharded_backend_version"] == 1
    assert sorted(os.listdir(tmp_path / "rng_state")) == ["shard_0_2.pt", "shard_1_2.pt"]
    assert "OK api-load world=2" in torchrun(2, "api-load", str(tmp_path))
    plain = dc.load_plain_tensors(str(tmp_path))
    ref = _worker_module().global_tensors()
    for key in ("rows.weight", "grid.bf16", "ids", "stacked"):
        assert torch.equal(_bits(plain[key]), _bits(ref[key])), key


def test_legacy_object_file_names(tmp_path):
    """Old Megatron-Core named object files with ``Path.with_suffix('.pt')``, which drops the
    last global-shape element: ``rng_state/shard_0.1_1.2`` was stored as ``shard_0.1_1.pt``."""
    dc = pytest.importorskip("ckpt_tool.dist_checkpointing")
    if not hasattr(dc, "load"):
        pytest.skip("ckpt_tool.dist_checkpointing.serialization is not available yet")
    from ckpt_tool.dist_checkpointing.mapping import ShardedObject

    _save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2))}, tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    torch.save({"iteration": 3}, tmp_path / "common.pt")
    (tmp_path / "rng_state").mkdir()
    for col in range(2):
        torch.save({"col": col}, tmp_path / "rng_state" / f"shard_0.{col}_1.pt")
    (tmp_path / "w.sync").mkdir()  # a synchronizer dir is neither an array nor an object

    meta = dc.serialization.load_sharded_metadata(str(tmp_path))
    assert set(meta) == {"w", "rng_state/shard_0.0_1.2", "rng_state/shard_0.1_1.2"}
    assert tuple(meta["rng_state/shard_0.1_1.2"].global_shape) == (1, 2)
    request = {"obj": ShardedObject("rng_state", None, (1, 2), (0, 1)),
               "w": _request("w", (2, 2), torch.float32)}
    loaded = dc.load(request, str(tmp_path), validate_access_integrity=False)
    assert loaded["obj"] == {"col": 1} and loaded["iteration"] == 3
    assert torch.equal(loaded["w"], torch.ones(2, 2))
