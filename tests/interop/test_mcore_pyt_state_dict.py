"""Megatron-Core's PyT state-dict building blocks, ours against the real 0.16.1, both ways.

The real ``mcore_to_pyt_state_dict`` + ``MCoreSavePlanner`` save a checkpoint that our
building blocks and our TorchDistLoadShardedStrategy load, and the real ``MCoreLoadPlanner``
loads what ours saved; the conversion gives the same value types for the same pieces.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _pyt_sd_worker import OBJECT, STACKED, expected, request

if importlib.util.find_spec("megatron.core") is None:  # not imported here: it takes seconds
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

WORKER = Path(__file__).resolve().parent / "_pyt_sd_worker.py"


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """Ours saves first; then one MCore process saves its own and loads ours."""
    from ckpt_tool.dist_checkpointing import ShardedObject, ShardedTensor
    from ckpt_tool.dist_checkpointing.strategies import torch as st

    root = tmp_path_factory.mktemp("pyt")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
    try:
        pyt = st.mcore_to_pyt_state_dict(request(ShardedTensor, ShardedObject))
        ours_types = {k: type(v).__name__ for k, v in pyt.items()}
        dcp.save(pyt, checkpoint_id=str(root / "ours"),
                 planner=st.MCoreSavePlanner(flatten_state_dict=False))
    finally:
        dist.destroy_process_group()
    done = subprocess.run([sys.executable, str(WORKER), str(root / "result.json"),
                           str(root / "mcore"), str(root / "ours")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, ours_types, json.loads((root / "result.json").read_text())


def test_same_value_types(both):
    _, ours_types, theirs = both
    assert ours_types == theirs["types"]
    assert theirs["types"] == {"w": "LocalShardsContainer", "v": "CheckpointableShardedTensor",
                               "s": "ShardedTensor", "o/shard_0_1": "BytesIO"}


def test_mcore_loads_what_ours_saved(both):
    _, _, theirs = both
    assert theirs["loaded"] == {"w": True, "v": True, "s": True, "o/shard_0_1": [OBJECT]}


def test_ours_loads_what_mcore_saved(both):
    from ckpt_tool.dist_checkpointing import ShardedObject, ShardedTensor
    from ckpt_tool.dist_checkpointing.strategies import torch as st
    from ckpt_tool.dist_checkpointing.strategies._pyt_state_dict import (
        _unwrap_pyt_sharded_tensor,
    )

    ckpt = both[0] / "mcore"
    req = request(ShardedTensor, ShardedObject, fill=-1)
    del req["s"]  # a torch ShardedTensor needs a process group; the strategy reads it below
    pyt = st.mcore_to_pyt_state_dict(req, is_loading=True)
    dcp.load(pyt, storage_reader=st.CachedMetadataFileSystemReader(str(ckpt)), no_dist=True,
             planner=st.MCoreLoadPlanner(shapes_validation_sharded_tensors=req["w"]))
    for key in ("w", "v"):
        assert all(torch.equal(v, expected(key, i))
                   for i, v in enumerate(_unwrap_pyt_sharded_tensor(pyt[key]))), key
    assert _unwrap_pyt_sharded_tensor(pyt["o/shard_0_1"]) == [OBJECT]
    whole = st.TorchDistLoadShardedStrategy().load(
        {"s": ShardedTensor.from_rank_offsets("s", torch.zeros_like(STACKED))}, ckpt)
    assert torch.equal(whole["s"], STACKED)
