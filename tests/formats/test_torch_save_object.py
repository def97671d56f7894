"""torch_save_object: ``torch.save``'s bytes of a plain object (a common state, a ShardedObject
item) written without torch, compared with ``torch.save`` byte for byte; what it refuses."""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_tool.formats.legacy.writer import updated_args
from ckpt_tool.formats.containers.pickle.safe_pickle import load_torch_file
from ckpt_tool.formats.containers.torch_zip.torch_save_object import (
    TorchRef,
    archive_prefix,
    load_exact,
    object_item,
    save_object,
    torch_free_pickle,
)
from ckpt_tool.formats.containers.torch_zip.torch_zip_write import object_archive

FIX = Path(__file__).resolve().parents[2] / "fixtures"
COMMONS = ["mcore016_gpt_tp2pp2_modelonly", "mcore016_gpt_tp2pp2_bf16_optim",
           "mcore016_moe_pp2vpp2ep2_distopt_buckets", "mcore015_zarr_gpt_tp2pp2"]


def _torch_save(obj, path: Path) -> bytes:
    torch.save(obj, path)
    return path.read_bytes()


@pytest.mark.parametrize("name", COMMONS)
def test_common_state_bytes_are_torch_saves(tmp_path, name):
    """Loaded without torch (dtypes as TorchRef) and saved without torch == loaded with torch
    and ``torch.save``d, as is and with reshard's args changes (in one process: which strings
    are interned decides which strings the pickle shares, see docs/performance.md, "Reshard without torch")."""
    f = next((FIX / name).glob("iter_*")) / "common.pt"
    light, full = load_exact(f), load_torch_file(f)
    assert isinstance(light, dict) and isinstance(light["args"].params_dtype, TorchRef)
    changes = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
               "world_size": 1, "padded_vocab_size": 256}
    (tmp_path / "ours").mkdir()
    for a, b in ((light, full), ({**light, "args": updated_args(light["args"], changes)},
                                 {**full, "args": updated_args(full["args"], changes)})):
        assert save_object(a, tmp_path / "ours" / "common.pt")
        assert (tmp_path / "ours" / "common.pt").read_bytes() == _torch_save(
            b, tmp_path / "common.pt")


def test_plain_values_and_real_torch_dtypes(tmp_path):
    ns = argparse.Namespace(a=1, b="x", c=[1.5, None, True], d=torch.bfloat16,
                            e=np.float64(0.25), f=np.dtype("float32"), g=pathlib.PosixPath("/a/b"),
                            h=(1, (2, 3)), i=b"raw", j=-(1 << 70))
    shared = ["shared"]
    obj = {"args": ns, "x": shared, "y": shared, "z": {"k": torch.float32, 3: torch.bfloat16}}
    pkl = torch_free_pickle(obj)
    assert pkl is not None
    assert object_archive(pkl, "common") == _torch_save(obj, tmp_path / "common.pt")
    # TorchRef pickles as torch's dtype: the same bytes as the real one
    light = {**obj, "z": {"k": TorchRef.of("float32"), 3: TorchRef.of("bfloat16")},
             "args": argparse.Namespace(**{**vars(ns), "d": TorchRef.of("bfloat16")})}
    assert torch_free_pickle(light) == pkl
    assert pickle.loads(pkl)["z"]["k"] is torch.float32


def test_object_items_are_torch_saves_into_a_stream():
    for payload in (None, {"seed": 0}, [1, "a"], argparse.Namespace(x=torch.int64)):
        buf = io.BytesIO()
        torch.save([payload], buf)
        assert object_item(payload) == buf.getvalue()


def test_refuses_what_it_cannot_prove(tmp_path):
    from collections import OrderedDict

    from ckpt_tool.formats.containers.pickle.safe_pickle import stand_in_class

    for value in (torch.zeros(2), OrderedDict(a=1), {1, 2}, torch.Size([2]),
                  stand_in_class("megatron.core.enums", "ModelType")(), np.zeros(3),
                  type("Local", (), {})()):
        assert torch_free_pickle({"v": value}) is None, value
    # ... and then save_object is torch.save itself
    assert not save_object({"v": torch.zeros(2)}, tmp_path / "common.pt")
    assert torch.equal(torch.load(tmp_path / "common.pt")["v"], torch.zeros(2))
    # a common.pt holding tensors (a loss scaler's) or a torch alias name is loaded with torch
    assert load_exact(next((FIX / "mcore016_gpt_tp2dp2_fp16opt").glob("iter_*")) /
                      "common.pt") is None
    torch.save({"a": torch.tensor(1.0)}, tmp_path / "t.pt")
    assert load_exact(tmp_path / "t.pt") is None
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    assert load_exact(tmp_path / "junk.pt") is None


def test_a_torch_ref_never_pickles_as_a_reference_to_us():
    with pytest.raises(pickle.PicklingError):
        torch.save({"d": TorchRef.of("bfloat16")}, io.BytesIO())
    with pytest.raises(ValueError):
        TorchRef.of("float")  # an alias would come back under another name
    assert repr(TorchRef.of("bfloat16")) == repr(torch.bfloat16)


def test_archive_prefix_is_torch_saves(tmp_path):
    assert archive_prefix(tmp_path / "common.pt") == "common"
    assert archive_prefix("/x/é/common.pt") == "archive"
    (tmp_path / "ours").mkdir()
    assert save_object({"a": 1}, tmp_path / "ours" / "a.b.pt")
    assert (tmp_path / "ours" / "a.b.pt").read_bytes() == _torch_save({"a": 1},
                                                                      tmp_path / "a.b.pt")
