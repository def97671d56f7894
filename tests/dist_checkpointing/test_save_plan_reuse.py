"""The torch_dist save's planning as Megatron-Core 0.16.1 does it (Megatron-LM's
``test_global_metadata_reuse.py`` checks it on 8 ranks):

- no reduce-scatter: the coordinator gathers the local plans for the metadata (kept in it as
  ``all_local_plans``) and each rank makes its own global plan;
- ``cached_global_metadata`` stays None after a first save, and a loaded checkpoint's metadata
  given to a new strategy (as Megatron-LM does on resume) is reused as it is when every rank's
  plan is the stored one, and not when the structure changed;
- a plan the coordinator rejects raises on every rank (here: the one).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.utils import _DistWrapper

from ckpt_tool.dist_checkpointing import ShardedObject, ShardedTensor
from ckpt_tool.dist_checkpointing.strategies import torch as st
from ckpt_tool.dist_checkpointing.strategies.state_dict_saver import CheckpointPlanError

GLOBAL = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def _state(extra: bool = False) -> dict:
    sd = {"w": ShardedTensor.from_rank_offsets("w", GLOBAL.clone()),
          "o": ShardedObject("o", {"step": 3}, (1,), (0,))}
    if extra:
        sd["v"] = ShardedTensor.from_rank_offsets("v", GLOBAL[0].clone())
    return sd


def _load_w(ckpt) -> torch.Tensor:
    return st.TorchDistLoadShardedStrategy().load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, ckpt)["w"]


@pytest.fixture
def reduce_scatters(monkeypatch) -> list:
    calls: list = []
    original = _DistWrapper.reduce_scatter

    def counted(self, *args, **kwargs):
        calls.append(args[0] if args else None)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(_DistWrapper, "reduce_scatter", counted)
    return calls


def test_no_reduce_scatter_and_loaded_metadata_reuse(tmp_path, single_rank_group,
                                                     reduce_scatters):
    first = st.TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    (tmp_path / "a").mkdir()
    first.save(_state(), tmp_path / "a")
    assert reduce_scatters == []
    assert first.cached_global_metadata is None and not first.validated_loaded_metadata_reuse

    loader = st.TorchDistLoadShardedStrategy()
    loader.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, tmp_path / "a")
    loaded_md = loader.cached_global_metadata
    assert len(loaded_md.all_local_plans) == 1  # one stored local plan per rank
    stored_data = dict(loaded_md.storage_data)
    reduce_scatters.clear()  # DCP's load plans with one; only the saves must not

    resumed = st.TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    resumed.cached_global_metadata = loaded_md
    (tmp_path / "b").mkdir()
    resumed.save(_state(), tmp_path / "b")
    assert reduce_scatters == []
    assert resumed.validated_loaded_metadata_reuse
    assert resumed.cached_global_metadata is loaded_md
    assert loaded_md.storage_data == stored_data  # the reused metadata itself is not changed
    # the next save reuses its own cached plan and that metadata
    (tmp_path / "c").mkdir()
    resumed.save(_state(), tmp_path / "c")
    assert resumed.validated_cache_reuse

    changed = st.TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    changed.cached_global_metadata = loaded_md
    (tmp_path / "d").mkdir()
    changed.save(_state(extra=True), tmp_path / "d")
    assert not changed.validated_loaded_metadata_reuse
    assert reduce_scatters == []
    assert torch.equal(_load_w(tmp_path / "b"), GLOBAL)
    assert torch.equal(_load_w(tmp_path / "c"), GLOBAL)
    assert torch.equal(_load_w(tmp_path / "d"), GLOBAL)
    assert torch.equal(st.TorchDistLoadShardedStrategy().load(
        {"v": ShardedTensor.from_rank_offsets("v", torch.zeros(6))}, tmp_path / "d")["v"],
        GLOBAL[0])


def test_a_strategy_that_saved_before_reuses_a_loaded_metadata(tmp_path, single_rank_group):
    """Megatron-LM's default save strategy is one object per process: on resume the strategy
    that saved before gets the loaded metadata. As in MCore, its earlier (not yet validated)
    plan does not bypass the check of the loaded metadata, which is then used as it is."""
    strategy = st.TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)
    (tmp_path / "a").mkdir()
    strategy.save(_state(), tmp_path / "a")
    assert not strategy.validated_cache_reuse  # one save validates nothing yet
    loader = st.TorchDistLoadShardedStrategy()
    loader.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))}, tmp_path / "a")
    strategy.cached_global_metadata = loaded_md = loader.cached_global_metadata
    (tmp_path / "b").mkdir()
    strategy.save(_state(), tmp_path / "b")
    assert strategy.validated_loaded_metadata_reuse
    assert strategy.cached_global_metadata is loaded_md
    assert strategy.validated_cache_reuse  # the same plan twice: validated
    assert torch.equal(_load_w(tmp_path / "b"), GLOBAL)


def test_rejected_plan_raises(tmp_path, single_rank_group):
    overlapping = {"a": ShardedTensor.from_rank_offsets("w", GLOBAL.clone()),
                   "b": ShardedTensor.from_rank_offsets("w", GLOBAL[2:].clone(), (0, 1, 2))}
    with pytest.raises(CheckpointPlanError, match="plan rejected"):
        st.TorchDistSaveShardedStrategy("torch_dist", 1).save(overlapping, tmp_path)
    assert not (tmp_path / ".metadata").exists()
