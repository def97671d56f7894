"""Bounded memory of ``convert`` between HF and Megatron-Core: the anonymous memory a convert
holds at its peak stays near the largest tensor, whatever the checkpoint's size.

A random Llama whose largest tensors (embedding, output layer) are 64 MiB and ~200 MB in all,
written by safetensors' ``save_file``; imported to torch_dist by ``ckpt convert``, that import
re-saved as Megatron-Core stores it (each stacked ``decoder.layers.*`` tensor one item) by the
real ``torch.distributed.checkpoint.save``, then exported back with ``--to hf``. Each command
runs in a child whose ``RssAnon`` (``/proc/PID/status``) is sampled while it runs: the peak,
less the peak of the same command on a tiny model (same imports), must stay under 2x the
largest tensor. File-backed pages (mapped checkpoint files, page cache) are not counted: they
are clean and reclaimable. Before the fix the import held the embedding twice (bytes, then a
bytearray copy) and the export copied a whole stacked item to align it (2.3-2.6x).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _hf_dirs import llama_dir  # noqa: E402
from _peak_memory import ckpt_peak  # noqa: E402

LARGEST = 64 << 20
BIG = dict(hidden=1024, inter=1024, layers=4, heads=8, kv=2, vocab=16384, shards=3)
TINY = dict(hidden=64, inter=128, layers=2, heads=8, kv=2, vocab=1024, shards=1)


def _peak_anon(*args) -> int:
    """``python -m ckpt_tool ARGS`` in a child; its peak RssAnon in bytes (sampled)."""
    return ckpt_peak(*args).anon


def _as_mcore_saves(ours: Path, out: Path) -> None:
    """``ours`` (our torch_dist: a chunk per layer) re-saved with each tensor one DCP item, by
    torch.distributed.checkpoint (what Megatron-Core's torch_dist backend drives)."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.formats.base import open_checkpoint

    with open_checkpoint(ours) as reader:
        sd = {k: reader.read(k) for k in reader.metadata().tensors}
    dcp.save(sd, checkpoint_id=out, no_dist=True)
    del sd
    for name in ("common.pt", "metadata.json"):
        shutil.copy(ours / name, out / name)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"big": llama_dir(root / "big", **BIG), "tiny": llama_dir(root / "tiny", **TINY)}


def test_convert_anonymous_peak_stays_near_the_largest_tensor(models, tmp_path):
    cfg = json.loads((models["big"] / "config.json").read_text())
    assert cfg["vocab_size"] * cfg["hidden_size"] * 4 == LARGEST
    total = sum(p.stat().st_size for p in models["big"].glob("*.safetensors"))
    assert total > 3 * LARGEST
    peaks = {}
    for size in ("tiny", "big"):
        ours, mc, hf = tmp_path / f"{size}-ours", tmp_path / f"{size}-mc", tmp_path / f"{size}-hf"
        peaks[size, "torch_dist"] = _peak_anon("convert", models[size], ours, "--to",
                                               "torch_dist", "--no-progress")
        _as_mcore_saves(ours, mc)
        peaks[size, "hf"] = _peak_anon("convert", mc, hf, "--to", "hf", "--no-progress")
    got = {to: (peaks["big", to] - peaks["tiny", to]) / LARGEST for to in ("torch_dist", "hf")}
    print({k: v >> 20 for k, v in peaks.items()}, "MiB peak RssAnon;", got)
    for to, ratio in got.items():
        assert ratio < 2.0, (f"--to {to}: peak anonymous memory {ratio:.2f}x the largest "
                             f"tensor above a tiny model's ({peaks['big', to] >> 20} MiB)")
    from safetensors.torch import load_file

    weight_map = json.loads((models["big"] / "model.safetensors.index.json").read_text())[
        "weight_map"]
    back = load_file(tmp_path / "big-hf" / "model.safetensors")  # one file: under 5 GB
    for name in ("model.embed_tokens.weight", "lm_head.weight",
                 "model.layers.3.mlp.up_proj.weight"):
        assert torch.equal(load_file(models["big"] / weight_map[name])[name], back[name])
