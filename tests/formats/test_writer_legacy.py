"""The legacy writer, through ``ops.convert``: per-rank files as Megatron-LM writes them."""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import pytest
import torch

from ckpt_tool.errors import UsageError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert

FIX = Path(__file__).resolve().parents[2] / "fixtures"
LEGACY = FIX / "megatron_legacy_tp2pp2"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"


def _rank_files(root: Path) -> list[str]:
    return sorted(glob.glob(str(root / "iter_*" / "mp_rank_*" / "model_optim_rng.pt")))


def _assert_same_rank_files(expected_root: Path, got_root: Path, *, rng: bool) -> None:
    want, got = _rank_files(expected_root), _rank_files(got_root)
    assert [Path(p).parent.name for p in want] == [Path(p).parent.name for p in got]
    for a, b in zip(want, got):
        x = torch.load(a, weights_only=False)
        y = torch.load(b, weights_only=False)
        assert set(x["model"]) == set(y["model"]), a  # the _extra_state entries too
        for k, v in x["model"].items():
            w = y["model"][k]
            if v is None:  # a Megatron-Core linear's _extra_state
                assert w is None, (a, k)
            else:
                assert v.dtype == w.dtype and torch.equal(v, w), (a, k)
        assert y["iteration"] == x["iteration"]
        assert y["args"].tensor_model_parallel_size == x["args"].tensor_model_parallel_size
        if rng:
            assert torch.equal(torch.as_tensor(x["rng_state"][0]["torch_rng_state"]),
                               torch.as_tensor(y["rng_state"][0]["torch_rng_state"]))


def test_legacy_to_legacy_reproduces_every_rank_file(tmp_path):
    result = convert(LEGACY, tmp_path / "out", ConvertOptions(to="legacy"))
    assert result.verified and result.format == "legacy"
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text() == "10"
    _assert_same_rank_files(LEGACY, tmp_path / "out", rng=True)


def test_flat_full_model_split_like_megatron_lm(tmp_path):
    """TP1/PP1 tensors in one torch.save file -> --tp 2 --pp 2 gives Megatron-LM's rank files."""
    full = {}
    with open_checkpoint(LEGACY) as r:
        for k in r.metadata().tensors:
            full[k] = r.read(k).clone()
        args = dict(r.common()["args"])
    del args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]  # no layout
    args = argparse.Namespace(**args)
    torch.save({"model": full, "args": args, "iteration": 10}, tmp_path / "full.pt")
    result = convert(tmp_path / "full.pt", tmp_path / "out",
                     ConvertOptions(to="legacy", rename=(("model.", ""),)), tp=2, pp=2)
    assert result.tensors == len(full)
    want = _rank_files(LEGACY)
    got = sorted(glob.glob(str(tmp_path / "out" / "*" / "mp_rank_*" / "model_optim_rng.pt")))
    assert [Path(p).parent.name for p in want] == [Path(p).parent.name for p in got]
    for a, b in zip(want, got):
        x = torch.load(a, weights_only=False)["model"]
        y = torch.load(b, weights_only=False)["model"]
        assert set(x) == set(y), a  # the linears' _extra_state entries (None) too
        for k, v in x.items():
            assert y[k] is None if v is None else torch.equal(v, y[k]), (a, k)


def test_dist_stacked_layers_are_written_per_layer(tmp_path):
    convert(DIST, tmp_path / "out", ConvertOptions(to="legacy"))
    with open_checkpoint(DIST) as d, open_checkpoint(tmp_path / "out") as leg:
        dm, lm = d.metadata(), leg.metadata()
        assert lm.format == "legacy" and lm.extras["tp"] == 2 and lm.extras["pp"] == 2
        n = 0
        for key, t in dm.tensors.items():
            if key.startswith("decoder.layers."):
                for layer in range(t.shape[0]):
                    local = key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
                    assert torch.equal(leg.read(local), d.read(key)[layer]), local
                    n += 1
            else:
                assert torch.equal(leg.read(key), d.read(key)), key
        assert n == 4 * 12


def test_changing_the_layout_is_refused(tmp_path):
    with pytest.raises(UsageError, match="reshard"):
        convert(LEGACY, tmp_path / "out", ConvertOptions(to="legacy"), tp=4)
    assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="only apply with --to legacy"):
        convert(LEGACY, tmp_path / "out2", ConvertOptions(to="torch"), tp=2)
