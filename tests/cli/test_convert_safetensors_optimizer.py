"""Issue 16 item 5: ``--to safetensors`` keeps the model's weights alone in model.safetensors
(what HF loaders read); the optimizer state goes beside them, in optimizer.safetensors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.model import is_optimizer_key

REPO = Path(__file__).resolve().parents[2]
OPTIM = REPO / "fixtures" / "mcore016_gpt_tp2pp2_bf16_optim"


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_model_safetensors_holds_no_optimizer_state(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "st"
    res = _run("convert", str(OPTIM), str(out), "--to", "safetensors", "--quiet")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-manifest.json", "model.safetensors",
                                                   "optimizer.safetensors"]
    with safe_open(out / "model.safetensors", "pt") as f:
        model = set(f.keys())
    with safe_open(out / "optimizer.safetensors", "pt") as f:
        optim = set(f.keys())
    assert model and not any(is_optimizer_key(k) for k in model)
    assert optim and all(is_optimizer_key(k) for k in optim)
    res = _run("diff", str(OPTIM), str(out), "--json", "--quiet")  # read back as one
    assert res.exit_code == 0 and json.loads(res.stdout)["stats"]["tensors_compared"] == 64


def test_shards_of_each_with_their_own_index(tmp_path):
    out = tmp_path / "sh"
    res = _run("convert", str(OPTIM), str(out), "--to", "safetensors", "--max-shard-size",
               "20KB", "--quiet")
    assert res.exit_code == 0, res.output
    model = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    optim = json.loads((out / "optimizer.safetensors.index.json").read_text())["weight_map"]
    assert not any(is_optimizer_key(k) for k in model) and all(map(is_optimizer_key, optim))
    assert all(v.startswith("model-") for v in model.values())
    assert all(v.startswith("optimizer-") for v in optim.values())
    res = _run("validate", str(out), "--quiet")
    assert res.exit_code == 0, res.output
    res = _run("inspect", str(out), "--json")
    assert res.exit_code == 0 and len(json.loads(res.stdout)["tensors"]) == 64


def test_model_only_writes_model_safetensors_alone(tmp_path):
    out = tmp_path / "mo"
    res = _run("convert", str(OPTIM), str(out), "--to", "safetensors", "--model-only",
               "--quiet")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["ckpt-manifest.json", "model.safetensors"]


def test_one_safetensors_file_is_the_model_and_says_the_optimizer_was_left_out(tmp_path):
    out = tmp_path / "model.safetensors"
    res = _run("convert", str(OPTIM), str(out), "--to", "safetensors")
    assert res.exit_code == 0, res.output
    assert "holds the model's weights only: optimizer state left out" in res.stderr
    res = _run("inspect", str(out), "--json")
    keys = json.loads(res.stdout)["tensors"]
    assert keys and not any(is_optimizer_key(k if isinstance(k, str) else k["key"])
                            for k in keys)
