"""``ckpt convert LEGACY --to torch_dist`` gives what Megatron-LM's own conversion gives.

Megatron-LM (tag core_v0.16.1, real ``megatron.core.dist_checkpointing``, 4 gloo ranks on CPU)
converts ``fixtures/megatron_legacy_tp2pp2`` with ``--ckpt-convert-format torch_dist``
(``_legacy_convert_worker.py``: the model built from its command line, each rank's legacy file
loaded into it, the model saved as torch_dist). Ours must hold the same model: every tensor
under Megatron-Core's stacked name with the same shape, dtype and values, every
``_extra_state`` object stored byte for byte as there (ours adds the final norm's, a
``TENorm``'s wherever Transformer Engine is installed, which this CPU run has not), and each
rank's ``rng_state`` object with the states the legacy files hold (the CUDA generator's aside:
on a CPU host Megatron-LM's ``torch.cuda.set_rng_state`` has nothing to set, so it saves the
host's). Skipped, saying why, without Megatron-LM's files (``fetch_megatron.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fetch_megatron  # noqa: E402
from _megatron_lm import run_worker  # noqa: E402

from ckpt_tool.formats.base import open_checkpoint  # noqa: E402
from ckpt_tool.ops.convert import ConvertOptions  # noqa: E402
from ckpt_tool.ops.convert import convert  # noqa: E402

pytestmark = [pytest.mark.interop, pytest.mark.multiproc]
LEGACY = HERE.parent.parent / "fixtures" / "megatron_legacy_tp2pp2"
WORKER = HERE / "_legacy_convert_worker.py"
FINAL_NORM = "decoder.final_layernorm._extra_state/shard_0_1"


def _without_cuda_state(states: list) -> list:
    return [{k: v for k, v in s.items() if k != "cuda_rng_state"} for s in states]


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if hasattr(a, "shape"):  # numpy arrays (the numpy generator's state)
        return bool((a == b).all())
    return a == b


def test_ours_is_megatron_lms_own_conversion(tmp_path: Path) -> None:
    root = fetch_megatron.ensure_or_skip()
    log = run_worker(root, "real", WORKER, 4, str(LEGACY), str(tmp_path / "mlm"))
    assert "> converted checkpoint: torch -> torch_dist." in log, log[-3000:]
    convert(LEGACY, tmp_path / "ours", ConvertOptions(to="torch_dist"))
    with open_checkpoint(tmp_path / "mlm" / "torch_dist", trust=True) as theirs, \
            open_checkpoint(tmp_path / "ours") as ours:
        mt, mo = theirs.metadata(), ours.metadata()
        assert set(mo.tensors) == set(mt.tensors) and len(mt.tensors) == 17
        for key, t in mt.tensors.items():
            assert (mo.tensors[key].shape, mo.tensors[key].dtype) == (t.shape, t.dtype), key
            assert torch.equal(ours.read(key), theirs.read(key)), key
        objects_t = {o.unique_key for o in mt.objects}
        objects_o = {o.unique_key for o in mo.objects}
        assert objects_o - objects_t == {FINAL_NORM} and objects_t <= objects_o
        extra = [k for k in objects_t if "._extra_state/" in k]
        assert len(extra) == 16
        for key in extra:
            assert ours.stored_object_bytes(key) == theirs.stored_object_bytes(key), key
        rng = sorted(k for k in objects_t if k.startswith("rng_state/"))
        assert rng == [f"rng_state/shard_{p}.{t}_2.2" for p in range(2) for t in range(2)]
        for key in rng:
            assert _same(_without_cuda_state(ours.read_object(key)),
                         _without_cuda_state(theirs.read_object(key))), key
        assert ours.common()["iteration"] == theirs.common()["iteration"] == 10
