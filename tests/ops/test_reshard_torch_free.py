"""reshard of a torch_dist source without torch: the numpy read path, numpy re-padding and the
torch-free common state write the same files as the torch path (tensors read through torch,
rows re-padded with torch, ``torch.save`` of the common state), and a fresh process never
imports torch."""

from __future__ import annotations

import filecmp
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckpt_tool.ops.reshard as reshard_op
from ckpt_tool.ops.reshard._io import PaddedSource
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
MODEL_ONLY = next((FIX / "mcore016_gpt_tp2pp2_modelonly").glob("iter_*"))
OPTIM = next((FIX / "mcore016_gpt_tp2pp2_bf16_optim").glob("iter_*"))


def _torch_path(monkeypatch) -> None:
    """What reshard did before: tensors through torch, the common state loaded with torch."""
    monkeypatch.setattr(reshard_op, "reshard_source",
                        lambda reader, target, fill, to: PaddedSource(reader, target, fill=fill))
    monkeypatch.setattr(reshard_op, "_source_common", lambda reader: (reader.common(), False))


def _same_checkpoints(a: Path, b: Path, *, common_bytes: bool) -> None:
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for name in names:
        if name == ".metadata":  # a fresh save_id and the path: the rest equal
            ma, mb = (pickle.loads((d / name).read_bytes()) for d in (a, b))
            ma.storage_meta = mb.storage_meta = None
            assert ma == mb
        elif name == "common.pt" and not common_bytes:
            ca, cb = (torch.load(d / name, weights_only=False) for d in (a, b))
            assert ca == cb and all(pickle.dumps(ca[k]) == pickle.dumps(cb[k]) for k in ca)
        elif name != "integrity.json":  # names the files' paths; digests checked by verify
            assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.mark.parametrize("src, tp, pp, common_bytes", [
    (MODEL_ONLY, 1, 1, True),
    (MODEL_ONLY, 4, 1, True),  # padded vocab 128 -> 256: rows copied
    (OPTIM, 4, 2, False),  # optimizer moments re-padded too
])
def test_same_files_as_the_torch_path(tmp_path, monkeypatch, src, tp, pp, common_bytes,
                                      raw_saves):
    """The data files and ``.metadata`` of the torch path; ``common.pt`` byte for byte where
    no attribute name of ``args`` comes back as a shared string elsewhere (the optimizer's
    param groups: with torch imported, Python has interned ``lr``, ``weight_decay``... before
    the load, so the pickle shares them differently), else equal values."""
    ours = reshard(src, tmp_path / "ours", ReshardRequest(tp=tp, pp=pp))
    assert ours.written and len(raw_saves) == 1
    with monkeypatch.context() as m:
        _torch_path(m)
        assert reshard(src, tmp_path / "torch", ReshardRequest(tp=tp, pp=pp)).written
    inside = src.name  # an iteration directory gives one
    _same_checkpoints(tmp_path / "ours" / inside, tmp_path / "torch" / inside,
                      common_bytes=common_bytes)


def test_zero_fill_stays_on_torch(tmp_path):
    """``--vocab-fill zero`` pads with ``row * 0`` (signed zeros, as before): through torch."""
    from ckpt_tool.formats import open_checkpoint
    from ckpt_tool.ops.reshard._io import reshard_source

    out = reshard(MODEL_ONLY, tmp_path / "z", ReshardRequest(tp=4, pp=1, vocab_fill="zero"))
    assert out.written
    with open_checkpoint(MODEL_ONLY) as src, open_checkpoint(tmp_path / "z") as dst:
        target = dst.metadata()
        assert reshard_source(src, target, "zero", "torch_dist").raw is None
        assert reshard_source(src, target, "copy", "torch_dist").raw is not None
        assert reshard_source(src, target, "copy", "legacy").raw is None
        emb = "embedding.word_embeddings.weight"
        assert torch.equal(dst.read(emb)[128:].abs(), torch.zeros(128, 64, dtype=torch.bfloat16))


def test_a_fresh_process_reshards_a_model_only_checkpoint_without_torch(tmp_path):
    out = tmp_path / "out"
    code = ("import sys, json; from ckpt_tool.ops.reshard import reshard, ReshardRequest;"
            f"r = reshard({str(MODEL_ONLY)!r}, {str(out)!r}, ReshardRequest(tp=4, pp=1),"
            " workers=2);"
            "print(json.dumps([r.written, 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(
                              Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, False]
    out = out / MODEL_ONLY.name  # an iteration directory gives one
    assert (out / "common.pt").is_file() and (out / ".metadata").is_file()
