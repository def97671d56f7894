"""The REAL Megatron-Core 0.16.1 loads our reshard outputs at the target layout (torchrun/gloo):
every parameter equals what it loads from the source checkpoint itself."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.save_dir import locate_source
from ckpt_tool.ops.reshard import ReshardRequest, reshard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist_checkpointing" / "_workers"))
from launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
FIX = Path(__file__).resolve().parents[2] / "fixtures"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"
LEGACY = FIX / "megatron_legacy_tp2pp2"
WORKER = Path(__file__).resolve().parent / "_reshard_worker.py"


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)])
def test_megatron_core_loads_resharded_dist_and_legacy(tmp_path, tp, pp, raw_saves):
    pytest.importorskip("megatron.core")
    outs = []
    for name, src, to in (("from_dist", DIST, None), ("from_legacy", LEGACY, "torch_dist")):
        out = tmp_path / name
        before = len(raw_saves)
        reshard(src, out, ReshardRequest(tp=tp, pp=pp, to=to))
        assert len(raw_saves) == before + 1  # our raw save, not DCP's
        outs.append(str(locate_source(out).checkpoint))  # (in its save directory)
    ref = str(next(DIST.glob("iter_*")))
    log = torchrun(str(WORKER), tp * pp, str(tp), str(pp), ref, *outs, timeout=600)
    assert log.count(": OK ") == tp * pp, log[-3000:]


def test_megatron_core_loads_a_no_args_reshard_with_its_vocab_rows_kept(tmp_path):
    """No args: the source layout comes from the checkpoint itself and the 128 vocab rows (not
    Megatron-LM's padding at tp2 with the default 128) are kept; the TP4 result loads into the
    model that wrote the source. (Megatron-Core would also load re-padded vocab rows: it allows
    a vocab shape mismatch, so the row count is asserted here and the strict legacy load in
    tests/ops/test_reshard_resume.py.)"""
    import shutil

    import torch

    pytest.importorskip("megatron.core")
    src = tmp_path / "noargs"
    shutil.copytree(next(DIST.glob("iter_*")), src)
    common = torch.load(src / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, src / "common.pt")
    out = tmp_path / "o"
    assert reshard(src, out, ReshardRequest(tp=4, pp=1)).written
    from ckpt_tool.formats import open_checkpoint

    emb = open_checkpoint(out).metadata().tensors["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 64)
    log = torchrun(str(WORKER), 4, "4", "1", str(next(DIST.glob("iter_*"))), str(out),
                   timeout=900)
    assert log.count(": OK ") == 4, log[-3000:]
