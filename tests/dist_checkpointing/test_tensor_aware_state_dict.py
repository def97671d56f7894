"""MCoreTensorAwareStateDict: split a sharded state dict, pop/insert its tensors, rebuild it.

Without nvidia_resiliency_ext, ``from_state_dict`` raises ImportError as in Megatron-Core; the
other tests pretend the package is there (the class needs nothing from it).
"""

from __future__ import annotations

import sys

import pytest
import torch

from ckpt_tool.dist_checkpointing import tensor_aware_state_dict as tasd_mod
from ckpt_tool.dist_checkpointing.core import CheckpointingException
from ckpt_tool.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from ckpt_tool.dist_checkpointing.validation import StrictHandling

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent / "_workers"))
from launch import torchrun  # noqa: E402

TASD = tasd_mod.MCoreTensorAwareStateDict
W = torch.arange(12, dtype=torch.float32).reshape(3, 4)
B = torch.tensor([1, 2, 3], dtype=torch.int64)
F = torch.arange(8, dtype=torch.bfloat16)


def _halves(key, data, replica_id, flattened_range):
    return {"lo": ShardedTensor.from_rank_offsets(f"{key}.lo", data[:4].clone()),
            "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", data[4:].clone())}


def _concat(sub):
    return torch.cat([sub["lo"], sub["hi"]])


def _state(empty: bool = False) -> dict:
    """A state dict of every kind of value; ``empty`` gives the matching load request."""
    def data(t):
        return torch.zeros_like(t) if empty else t.clone()
    return {
        "w": ShardedTensor.from_rank_offsets("w", data(W)),
        "nested": {"b": ShardedTensor.from_rank_offsets("b", data(B)),
                   "obj": ShardedObject("obj", None if empty else {"seed": 3}, (1,), (0,))},
        "fac": ShardedTensorFactory("fac", data(F), _halves, _concat),
        "step": 11,
        "local": LocalNonpersistentObject("here"),
    }


@pytest.fixture
def nvrx(monkeypatch):
    monkeypatch.setattr(tasd_mod, "HAVE_NVRX", True)


def test_from_state_dict_needs_nvidia_resiliency_ext():
    if tasd_mod.HAVE_NVRX:
        pytest.skip("nvidia_resiliency_ext is installed")
    with pytest.raises(ImportError, match="nvidia-resiliency-ext"):
        TASD.from_state_dict(_state())


def test_pop_insert_to_state_dict_round_trip(nvrx):
    tasd, distribution = TASD.from_state_dict(_state(), algo="atomic")
    assert distribution == (None, None, None, None)
    assert tasd.common_state_dict == {"step": 11}
    popped = tasd.pop_tensors()
    assert tasd.is_hollow and [tuple(t.shape) for t in popped] == [(3, 4), (3,), (4,), (4,)]
    assert all(sh.data is None for sh in (tasd.sharded_state_dict["w"],
                                          tasd.sharded_state_dict["nested"]["b"]))
    tasd.insert_tensors(popped)
    assert not tasd.is_hollow
    out = tasd.to_state_dict(_state(empty=True))
    assert set(out) == {"w", "nested", "fac", "step", "local"}
    assert out["w"] is popped[0] and torch.equal(out["w"], W)
    assert torch.equal(out["nested"]["b"], B) and out["nested"]["obj"] == {"seed": 3}
    assert torch.equal(out["fac"], F) and out["fac"].dtype == torch.bfloat16
    assert out["step"] == 11 and out["local"] == "here"
    assert tasd.to_state_dict({}) == {"step": 11}


def test_hollow_state_is_enforced(nvrx):
    tasd, _ = TASD.from_state_dict(_state(), algo="atomic")
    with pytest.raises(CheckpointingException, match="not hollow"):
        tasd.insert_tensors([])
    popped = tasd.pop_tensors()
    for call in (tasd.pop_tensors, lambda: list(tasd.tensors),
                 lambda: tasd.to_state_dict(_state(empty=True))):
        with pytest.raises(CheckpointingException, match="hollow"):
            call()
    tasd.init_tensors()  # instead of inserting: fresh tensors like the popped ones
    assert [(t.shape, t.dtype) for t in tasd.tensors] == [(t.shape, t.dtype) for t in popped]
    with pytest.raises(NotImplementedError, match="atomic"):
        tasd.to_state_dict(_state(empty=True), algo="other")


def test_copy_tensors_to_cpu_leaves_originals_alone(nvrx):
    tasd, _ = TASD.from_state_dict(_state(), algo="atomic")
    before = list(tasd.tensors)
    tasd.copy_tensors_to_cpu()
    after = list(tasd.tensors)
    assert all(a.data_ptr() != b.data_ptr() and torch.equal(a, b) for a, b in zip(after, before))
    after[0].fill_(0)
    assert torch.equal(before[0], W)
    tasd.restore_tensor_device()  # CPU data: nothing to move
    assert list(tasd.tensors)[0] is after[0]


def test_unexpected_keys_are_reported_then_fail_as_in_megatron_core(nvrx):
    """The pass-through strict modes serve the request unfiltered, as Megatron-Core 0.16.1
    (its test_strict.py ``test_passthrough_errors``): an unexpected key raises an
    AssertionError (also our CheckpointingException); RAISE_UNEXPECTED names it first."""
    tasd, _ = TASD.from_state_dict(_state(), algo="atomic")
    request = _state(empty=True)
    request["extra"] = ShardedTensor.from_rank_offsets("extra", torch.zeros(2))
    for strict in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.ASSUME_OK_UNEXPECTED):
        with pytest.raises(AssertionError, match="'extra'") as err:
            tasd.to_state_dict(request, strict=strict, return_mismatch_keys=True)
        assert isinstance(err.value, CheckpointingException)
    with pytest.raises(CheckpointingException, match="extra") as err:
        tasd.to_state_dict(request, strict=StrictHandling.RAISE_UNEXPECTED)
    assert not isinstance(err.value, AssertionError)
    del request["nested"]["b"]  # a missing key alone is fine: reported, the rest served
    del request["extra"]
    out, missing, unexpected = tasd.to_state_dict(
        request, strict=StrictHandling.RETURN_ALL, return_mismatch_keys=True)
    assert missing == {"b"} and unexpected == set() and torch.equal(out["w"], W)


def test_single_process_fully_parallel_is_atomic(nvrx):
    tasd, distribution = TASD.from_state_dict(_state(), algo="fully_parallel")
    assert distribution is None  # a one-rank group has nothing to spread
    out = tasd.to_state_dict(_state(empty=True), algo="fully_parallel")
    assert torch.equal(out["w"], W) and torch.equal(out["fac"], F)


@pytest.mark.multiproc
def test_fully_parallel_split_and_exchange_on_two_ranks():
    """Replicated tensors are held by one rank each and exchanged back (every algorithm)."""
    out = torchrun("tasd_worker.py", 2, timeout=300)
    assert out.count("TASD OK") == 2, out[-3000:]
