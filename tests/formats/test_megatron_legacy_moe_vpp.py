"""Megatron-LM legacy format with a virtual pipeline (``model0``/``model1``) and expert
parallelism (``mp_rank_TT_PPP_EEE``): the assembled global tensors equal the state dict of the
same model built by Megatron-Core at TP=1 PP=1 EP=1 (``expected/tp1pp1.safetensors``)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from ckpt_tool.formats import detect, open_checkpoint

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "megatron_legacy_moe_vpp"


@pytest.fixture(scope="module")
def expected():
    return load_file(FIX / "expected" / "tp1pp1.safetensors")


@pytest.fixture(scope="module")
def reader():
    r = open_checkpoint(FIX)
    yield r
    r.close()


def test_detected_as_legacy_with_layout(reader):
    assert detect(FIX).name == "legacy"
    e = reader.metadata().extras
    assert (e["tp"], e["pp"], e["ep"]) == (1, 2, 2)
    assert e["virtual_pipeline"] == ["model0", "model1"]
    assert e["rank_files"] == [f"mp_rank_00_00{p}_00{x}/model_optim_rng.pt"
                               for p in (0, 1) for x in (0, 1)]
    assert e["missing_rank_files"] == [] and e["unmerged"] == [] and reader.problems == []


def test_keys_and_shapes_equal_tp1pp1_model(reader, expected):
    meta = reader.metadata()
    assert set(meta.tensors) == set(expected)
    for k, t in meta.tensors.items():
        assert t.shape == tuple(expected[k].shape) and t.dtype == "float32", k


def test_every_tensor_equals_tp1pp1_model(reader, expected):
    for k in sorted(reader.metadata().tensors):
        assert torch.equal(reader.read(k), expected[k]), k


def test_global_layer_and_expert_numbers(reader):
    meta = reader.metadata()
    # VPP 2 x PP 2, one layer per chunk: (pp, vp) -> global layer vp * 2 + pp
    want = {0: "mp_rank_00_000", 1: "mp_rank_00_001", 2: "mp_rank_00_000", 3: "mp_rank_00_001"}
    for layer, stage in want.items():
        t = meta.tensors[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"]
        assert t.chunks[0].file.startswith(stage)
        # global experts 0,1 live on EP rank 0, experts 2,3 on EP rank 1
        for e in range(4):
            t = meta.tensors[f"decoder.layers.{layer}.mlp.experts.local_experts.{e}"
                             ".linear_fc1.weight"]
            assert t.chunks[0].file == f"{stage}_00{e // 2}/model_optim_rng.pt"
        assert f"decoder.layers.{layer}.mlp.router.weight" in meta.tensors
        assert f"decoder.layers.{layer}.mlp.shared_experts.linear_fc2.weight" in meta.tensors


def test_sliced_expert_read_loads_one_rank_file(expected):
    with open_checkpoint(FIX) as r:
        k = "decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"
        assert torch.equal(r.read(k, (slice(5, 9), slice(0, 7))), expected[k][5:9, :7])
        assert list(r._files) == ["mp_rank_00_001_001/model_optim_rng.pt"]


def test_ep_replica_mismatch_is_a_problem(tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(FIX, broken, ignore=shutil.ignore_patterns("expected"))
    f = broken / "iter_0000010" / "mp_rank_00_000_001" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)
    state["model0"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 32, dtype=torch.float64)
    torch.save(state, f)
    r = open_checkpoint(broken)
    r.metadata()
    assert any(p.get("key") == "decoder.layers.0.mlp.router.weight"
               and p["file"].startswith("mp_rank_00_000_001") for p in r.problems), r.problems


def test_missing_expert_rank_listed(tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(FIX, broken, ignore=shutil.ignore_patterns("expected"))
    shutil.rmtree(broken / "iter_0000010" / "mp_rank_00_001_001")
    with open_checkpoint(broken) as r:
        files = r.rank_files()
    assert files["missing"] == ["mp_rank_00_001_001/model_optim_rng.pt"]
    assert len(files["expected"]) == 4 and len(files["present"]) == 3


def test_cli_inspect_json():
    from ckpt_tool.cli.app import app

    res = CliRunner().invoke(app, ["inspect", str(FIX), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["format"] == "legacy" and doc["totals"]["tensors"] == 72
