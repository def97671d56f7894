"""Interop with zarr checkpoints written by the REAL Megatron-Core 0.15.3.

* The committed fixture ``fixtures/mcore015_zarr_gpt_tp2pp2`` (a tiny bf16 GPT saved with
  TP2 PP2 by megatron-core 0.15.3) must load through ckpt_tool equal to tensorstore's raw reads.
* When a Python with megatron-core 0.15.3 is available (``CKPT_MCORE015_PYTHON``, default
  ``.venv015/bin/python`` in the repository, made by ``.ci/mcore015-venv`` (CI runs it), else
  ``/tmp/venv015/bin/python``),
  Megatron-Core and ckpt_tool write byte-identical checkpoints and load each other's.
"""

from __future__ import annotations

import filecmp
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.interop

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(os.environ.get(
    "CKPT_MCORE015_ZARR_FIXTURE", REPO / "fixtures" / "mcore015_zarr_gpt_tp2pp2" / "iter_0000010"))
WORKERS = REPO / "tests" / "dist_checkpointing" / "_workers"
MCORE015_PYTHON = os.environ.get("CKPT_MCORE015_PYTHON") or next(
    (str(p) for p in (Path(__file__).resolve().parents[2] / ".venv015" / "bin" / "python",
                      Path("/tmp/venv015/bin/python")) if p.exists()), "/tmp/venv015/bin/python")


def _ts_read(array_dir: Path, index=()) -> np.ndarray:
    import tensorstore as ts

    spec = {"driver": "zarr", "metadata_key": ".zarray",
            "kvstore": {"driver": "file", "path": str(array_dir)}}
    arr = ts.open(spec, open=True).result()
    return arr[index].read().result() if index else arr.read().result()


def _bits(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


def check_against_raw(ckpt: Path) -> dict:
    """Every tensor of ``ckpt`` loaded by ckpt_tool equals tensorstore's raw read (bit-exact)."""
    from ckpt_tool import dist_checkpointing as dc

    arrays = sorted(p.parent.name for p in ckpt.glob("*/.zarray") if not p.parent.name.endswith(".sync"))
    assert arrays, f"no zarr arrays in {ckpt}"
    meta = dc.load_tensors_metadata(str(ckpt))
    assert sorted(meta) == arrays
    plain = dc.load_plain_tensors(str(ckpt))
    assert set(arrays) <= set(plain)  # (Megatron-Core merges the common state in as well)
    for key in arrays:
        header = json.loads((ckpt / key / ".zarray").read_text())
        raw = _ts_read(ckpt / key)
        got = plain[key]
        assert tuple(got.shape) == tuple(header["shape"]) == tuple(meta[key].global_shape), key
        assert got.dtype == meta[key].dtype, key
        if header["dtype"] == "bfloat16":
            assert got.dtype == torch.bfloat16, key
        assert np.array_equal(_bits(got), _bits(raw)), key
    return plain


def check_resharded_load(ckpt: Path, plain: dict) -> None:
    """Load every tensor split in two along its first splittable axis (another sharding)."""
    from ckpt_tool import dist_checkpointing as dc
    from ckpt_tool.dist_checkpointing.mapping import ShardedTensor

    meta = dc.load_tensors_metadata(str(ckpt))
    request, expected = {}, {}
    for key, st in meta.items():
        shape = tuple(st.global_shape)
        axis = next((i for i, n in enumerate(shape) if n % 2 == 0), None)
        if axis is None:
            continue
        for part in range(2):
            piece = torch.empty(shape, dtype=st.dtype).chunk(2, axis)[part]
            name = f"{key}#{part}"
            request[name] = ShardedTensor.from_rank_offsets(key, piece.contiguous(), (axis, part, 2))
            expected[name] = plain[key].chunk(2, axis)[part]
    loaded = dc.load(request, str(ckpt), validate_access_integrity=False)
    for name, exp in expected.items():
        assert np.array_equal(_bits(loaded[name]), _bits(exp)), name


@pytest.mark.skipif(not FIXTURE.is_dir(), reason="fixture mcore015_zarr_gpt_tp2pp2 not generated yet")
def test_mcore015_gpt_fixture_loads_like_raw_tensorstore():
    from ckpt_tool import dist_checkpointing as dc

    config = json.loads((FIXTURE / "metadata.json").read_text())
    assert config["sharded_backend"] == "zarr"
    plain = check_against_raw(FIXTURE)
    assert any(getattr(t, "dtype", None) == torch.bfloat16 for t in plain.values())
    check_resharded_load(FIXTURE, plain)
    objects = {k: v for k, v in dc.serialization.load_sharded_metadata(str(FIXTURE)).items()
               if "/shard_" in k}
    assert any(k.startswith("rng_state/") for k in objects)
    for unique_key in objects:
        assert (FIXTURE / f"{unique_key}.pt").is_file(), unique_key
    # object files (RNG states, TE extra state) unpickle through the allowlisting loader
    loaded = dc.serialization.load_sharded_objects(dict(objects), str(FIXTURE))
    assert set(loaded) == set(objects)
    common = dc.load_common_state_dict(str(FIXTURE))
    assert common.get("iteration", 10) == 10


# ------------------------------------------------ live megatron-core 0.15.3 (manual, never CI)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mcore015_available() -> bool:
    if not os.path.exists(MCORE015_PYTHON):
        return False
    probe = "import importlib.metadata as m; print(m.version('megatron-core'))"
    out = subprocess.run([MCORE015_PYTHON, "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip().startswith("0.15.")


needs_mcore015 = pytest.mark.skipif(
    not _mcore015_available(), reason=f"no megatron-core 0.15.x at {MCORE015_PYTHON}")


def _torchrun(python: str, worker: str, *args: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [python, "-W", "ignore", "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(WORKERS / worker), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        rank_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank")]
        pytest.fail("torchrun failed:\n" + "\n".join(rank_lines[-60:]) + proc.stderr[-3000:])
    return proc.stdout


@pytest.fixture(scope="module")
def both_saves(tmp_path_factory):
    theirs = tmp_path_factory.mktemp("mcore015_zarr")
    ours = tmp_path_factory.mktemp("ckpt_zarr")
    assert "OK mcore015 save" in _torchrun(MCORE015_PYTHON, "zarr_mcore015.py", "save", str(theirs))
    assert "OK api-save" in _torchrun(sys.executable, "zarr_worker.py", "api-save", str(ours))
    return theirs, ours


@needs_mcore015
def test_our_save_is_byte_identical_to_mcore015(both_saves):
    theirs, ours = both_saves
    cmp = filecmp.dircmp(theirs, ours)

    def differences(c):
        out = c.left_only + c.right_only + c.diff_files + c.funny_files
        return out + [d for sub in c.subdirs.values() for d in differences(sub)]

    # shallow=False comparison of every common file
    for path in theirs.rglob("*"):
        if path.is_file():
            twin = ours / path.relative_to(theirs)
            assert twin.is_file() and filecmp.cmp(path, twin, shallow=False), path
    # ours adds only its integrity manifest (docs/formats.md section 11), which MCore ignores
    assert differences(cmp) == ["integrity.json"]


@needs_mcore015
def test_we_load_mcore015_save(both_saves):
    theirs, _ = both_saves
    assert "OK api-load" in _torchrun(sys.executable, "zarr_worker.py", "api-load", str(theirs))
    check_resharded_load(theirs, check_against_raw(theirs))


@needs_mcore015
def test_mcore015_loads_our_save(both_saves):
    _, ours = both_saves
    assert "OK mcore015 load" in _torchrun(MCORE015_PYTHON, "zarr_mcore015.py", "load", str(ours))
