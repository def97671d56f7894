"""Checkpoints written by the real Megatron-Core (fixtures/): our reads equal MCore 0.16.1's."""

from __future__ import annotations

import importlib.util

import math
from pathlib import Path

import pytest
import torch

from _compare import mcore_view, ours_view, same_value

if importlib.util.find_spec("megatron.core") is None:  # not imported here: it takes seconds
    pytest.skip("megatron-core is not installed", allow_module_level=True)
pytestmark = [pytest.mark.interop, pytest.mark.multiproc,
              pytest.mark.filterwarnings("ignore::UserWarning")]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TORCH_DIST = ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim",
              "mcore016_llama_tp2pp2_distopt", "mcore016_mixtral_ep2",
              "mcore016_deepseek_tp2ep2_distopt"]


def _ckpt(name: str) -> Path:
    root = FIXTURES / name
    found = sorted(p.parent for p in root.glob("*/metadata.json")) if root.is_dir() else []
    if not found:
        pytest.skip(f"fixture {name} not generated yet")
    return found[-1]


@pytest.mark.parametrize("name", TORCH_DIST)
def test_torch_dist_fixture_matches_mcore(name, tmp_path):
    ckpt = _ckpt(name)
    theirs, ours = mcore_view(ckpt, tmp_path / "mcore.pt"), ours_view(ckpt)
    assert ours["meta"] == theirs["meta"]
    assert ours["plain"].keys() == theirs["plain"].keys()
    for k in theirs["plain"]:
        assert same_value(ours["plain"][k], theirs["plain"][k]), k
    assert same_value(ours["objects"], theirs["objects"])
    assert same_value(ours["common"], theirs["common"])


def test_flattened_015_fixture(tmp_path):
    """MCore 0.16 returns N-D reformulated shapes; ours the original ones, same values."""
    ckpt = _ckpt("mcore015_gpt_flattened_optim")
    theirs, ours = mcore_view(ckpt, tmp_path / "mcore.pt"), ours_view(ckpt)
    assert ours["meta"].keys() == theirs["meta"].keys()
    reformulated = 0
    for k, (dtype, shape) in theirs["meta"].items():
        our_dtype, our_shape = ours["meta"][k]
        assert our_dtype == dtype
        if our_shape == shape:
            assert same_value(ours["plain"][k], theirs["plain"][k]), k
            continue
        # stored [X//x, Y//y, ..., x*y*...]; ours [X, Y, ...]
        reformulated += 1
        assert len(shape) == len(our_shape) + 1
        block = [o // s for o, s in zip(our_shape, shape[:-1])]
        assert math.prod(block) == shape[-1]
        n = len(block)
        stored = theirs["plain"][k].reshape(*shape[:-1], *block)
        order = [d for i in range(n) for d in (i, n + i)]
        dense = stored.permute(order).reshape(our_shape)
        assert same_value(ours["plain"][k], dense), k
    assert reformulated > 0
    assert same_value(ours["common"], theirs["common"])
