"""Optimizer-state sharding helpers: behaviour and equality with Megatron-Core."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from ckpt_tool.dist_checkpointing import mapping, optimizer
from ckpt_tool.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
)


@pytest.fixture(scope="module")
def mc():
    mmapping = pytest.importorskip("megatron.core.dist_checkpointing.mapping")
    moptim = pytest.importorskip("megatron.core.dist_checkpointing.optimizer")
    return mmapping, moptim


def make_model_and_optim():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    opt = torch.optim.Adam(
        [{"params": [model[0].weight, model[0].bias]}, {"params": [model[2].weight], "lr": 0.5}]
    )
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def sharded_model_sd(model, m, tp_rank=1, tp_size=2):
    """Model sharded state dict built with mapping module ``m``; bias 2 is left untracked."""
    sd = model.state_dict(keep_vars=True)
    return {
        "l0": {
            "weight": m.ShardedTensor.from_rank_offsets(
                "l0.weight", sd["0.weight"], (0, tp_rank, tp_size), replica_id=(0, 0, 1)),
            "bias": m.ShardedTensor.from_rank_offsets(
                "l0.bias", sd["0.bias"], (0, tp_rank, tp_size)),
        },
        "l2": [m.ShardedTensor.from_rank_offsets(
            "l2.weight", sd["2.weight"], (1, tp_rank, tp_size), prepend_axis_num=0)],
        "l2_bias": m.ShardedTensor.from_rank_offsets("l2.bias", sd["2.bias"]),
        "other": 3,
    }


def all_params(opt):
    return list(itertools.chain.from_iterable(g["params"] for g in opt.param_groups))


def test_param_to_id_map():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    assert optimizer.get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}


def test_id_to_sharded_param_map():
    model, opt = make_model_and_optim()
    sd = sharded_model_sd(model, mapping)
    id_map = optimizer.get_param_id_to_sharded_param_map(sd, all_params(opt))
    assert {i: t.key for i, t in id_map.items()} == {0: "l0.weight", 1: "l0.bias", 2: "l2.weight"}


def test_empty_map_warns(caplog):
    model, opt = make_model_and_optim()
    plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in plain.items()}
    with caplog.at_level(logging.WARNING):
        assert optimizer.get_param_id_to_sharded_param_map(sd, all_params(opt)) == {}
    assert "keep_vars=True" in caplog.text


def test_optim_state_to_sharding_state():
    model, opt = make_model_and_optim()
    id_map = optimizer.get_param_id_to_sharded_param_map(
        sharded_model_sd(model, mapping), all_params(opt))
    state = opt.state_dict()
    exp_avg_0 = state["state"][0]["exp_avg"]
    groups_before = [dict(g) for g in state["param_groups"]]
    optimizer.optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))

    assert set(state["state"]) == {0, 1, 2}
    assert set(state["state"][0]) == {"exp_avg", "exp_avg_sq"}
    sh = state["state"][0]["exp_avg"]
    assert sh.key == "optimizer.state.exp_avg.l0.weight"
    assert sh.data is exp_avg_0
    assert (sh.global_shape, sh.global_offset, sh.replica_id) == ((12, 4), (6, 0), (0, 0, 1))
    assert state["state"][2]["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.l2.weight"
    for before, group in zip(groups_before, state["param_groups"]):
        assert isinstance(group["params"], LocalNonpersistentObject)
        assert group["params"].unwrap() == before["params"]
        assert group["lr"] == before["lr"]


def test_unknown_param_id_raises():
    model, opt = make_model_and_optim()
    id_map = optimizer.get_param_id_to_sharded_param_map(
        sharded_model_sd(model, mapping), all_params(opt))
    del id_map[1]
    with pytest.raises(ValueError, match="Param id 1"):
        optimizer.optim_state_to_sharding_state(opt.state_dict(), id_map, exclude_keys=("step",))


def test_make_sharded_optimizer_tensor():
    param = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3, dtype=torch.bfloat16), (0, 1, 2))
    state = torch.ones(2, 3)  # fp32 state of a bf16 parameter
    sh = optimizer.make_sharded_optimizer_tensor(param, state, "optimizer.state.exp_avg")
    assert sh.key == "optimizer.state.exp_avg.w" and sh.dtype == torch.float32
    assert sh.global_offset == param.global_offset and param.key == "w"
    with pytest.raises(AssertionError, match="does not match model shape"):
        optimizer.make_sharded_optimizer_tensor(param, torch.ones(3, 2), "p")

    factory = ShardedTensorFactory("f", torch.zeros(2), lambda *a: {}, lambda s: s)
    made = optimizer.make_sharded_optimizer_tensor(factory, state, "pre")
    assert isinstance(made, ShardedTensorFactory)
    assert made.key == "pre.f" and made.data is state and factory.key == "f"


def _summary(state):
    return {
        pid: {
            name: (sh.key, tuple(sh.local_shape), sh.global_shape, sh.global_offset,
                   sh.axis_fragmentations, sh.replica_id, sh.dtype, sh.data.data_ptr())
            for name, sh in per_param.items()
        }
        for pid, per_param in state["state"].items()
    }


@pytest.mark.interop
def test_against_megatron_core(mc):
    mmapping, moptim = mc
    model, opt = make_model_and_optim()
    params = all_params(opt)

    ours_map = optimizer.get_param_id_to_sharded_param_map(sharded_model_sd(model, mapping), params)
    theirs_map = moptim.get_param_id_to_sharded_param_map(sharded_model_sd(model, mmapping), params)
    assert {i: t.key for i, t in ours_map.items()} == {i: t.key for i, t in theirs_map.items()}
    assert optimizer.get_optim_param_to_id_map(params) == moptim.get_optim_param_to_id_map(params)

    ours, theirs = opt.state_dict(), opt.state_dict()
    optimizer.optim_state_to_sharding_state(ours, ours_map, exclude_keys=("step",))
    moptim.optim_state_to_sharding_state(theirs, theirs_map, exclude_keys=("step",))
    assert _summary(ours) == _summary(theirs)
    assert [g["params"].unwrap() for g in ours["param_groups"]] == [
        g["params"].unwrap() for g in theirs["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in theirs["param_groups"]]
