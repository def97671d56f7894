"""``convert --to dcp`` on the raw path (``dcp_torch_free_save``), against DCP's own save.

The same conversion is run twice: through ``torch.distributed.checkpoint.save`` (the DCP path,
``torch_free_write_applies`` refused) and through our plan, archives and ``.metadata`` (the raw path,
``dcp.save`` refused). The data files must be byte for byte the same, ``.metadata`` an equal
``Metadata``, and torch's own loaders must read the output. The bytes items' archives made
without torch (``torch_save_object``, ``dcp_bytes_items``) are compared with ``torch.save``'s.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.formats.containers.dcp.dcp_bytes_items import flatten_state, unwrapped_archive
from ckpt_tool.formats.containers.torch_zip.torch_save_object import load_exact, object_archive_of

from _fixtures import fixture as _fixture

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def _torch_save(value) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# -- torch.save of plain values, without torch ---------------------------------------------
def test_plain_values_and_unwrapped_objects_are_torch_saves_bytes():
    import numpy as np
    import torch

    ns = argparse.Namespace(params_dtype=torch.bfloat16, main=torch.float32, half=torch.half,
                            seed=np.int64(3), lrs=[0.5] * 300, names=[f"n{i}" for i in range(300)],
                            again=torch.bfloat16, blob=b"\x00\xff", t=(1, "a"))
    for value in (ns, {"a": {"b": [1, 2.5, None, True]}}, "x" * 70000, [ns, ns], None, 2**70):
        loaded = load_exact(_torch_save(value))  # torch dtypes as stand-ins
        assert object_archive_of(loaded) == _torch_save(value)
    assert load_exact(_torch_save({"t": torch.zeros(2)})) is None  # a tensor needs torch
    assert load_exact(_torch_save(torch.device("cpu"))) is None
    # a type off the allowlist: the writer torch.saves it
    assert object_archive_of(collections.OrderedDict(x=1)) is None
    payloads = [None, ns, {"rng": torch.get_rng_state(), "cuda": [torch.zeros(0)],
                           "np": ("MT19937", np.arange(5, dtype=np.uint32), 1, 0.0)},
                [torch.arange(3)] * 300 + [torch.ones(2, dtype=torch.bfloat16)]]
    for payload in payloads:  # Megatron-Core's torch.save([payload]) -> torch.save(payload)
        assert unwrapped_archive(_torch_save([payload])) == _torch_save(payload)
    assert unwrapped_archive(_torch_save((1,))) is None  # not a one-item list
    assert unwrapped_archive(_torch_save([1, 2])) is None
    cyclic: list = []
    cyclic.append(cyclic)
    assert unwrapped_archive(_torch_save(cyclic)) is None  # refers to the list itself
    assert unwrapped_archive(b"not a zip") is None


def test_flatten_state_is_dcps():
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    state = {"optimizer": {"param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.99)},
                                            {"lr": 0.2, "params": []}]},
             "empty": {}, "lists": [[1, 2], [{"deep": 1}]], "plain": [1, "a"], 3: "int key",
             "tensors": [torch.zeros(1), 2], "od": collections.OrderedDict(b=1, a=2),
             "tuple_of_dicts": ({"a": 1},), "ns": argparse.Namespace(a={"x": 1})}
    flat, paths = flatten_state(state)
    theirs, their_paths = flatten_state_dict(state)
    assert list(flat) == list(theirs) and paths == their_paths
    assert all(flat[k] is theirs[k] for k in flat)


# -- the raw path against DCP's save -------------------------------------------------------
def _convert(src: Path, out: Path, monkeypatch, raw_saves, *, raw: bool, workers: int):
    import torch.distributed.checkpoint as dcp

    from ckpt_tool.formats.dcp import writer as dcp_writer
    from ckpt_tool.ops.convert import ConvertOptions
    from ckpt_tool.ops.convert import convert

    before = len(raw_saves)
    with monkeypatch.context() as m:
        if raw:
            m.setattr(dcp, "save", lambda *a, **k: pytest.fail("DCP's save was called"))
        else:
            m.setattr(dcp_writer, "torch_free_write_applies", lambda *a: False)
        result = convert(src, out, ConvertOptions(to="dcp"), workers=workers)
    assert result.verified
    assert len(raw_saves) == before + raw
    return result


def _equal(a, b) -> bool:
    """Equal values, tensors bit for bit (anywhere inside containers)."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape \
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _equal(vars(a), vars(b))
    return pickle.dumps(a) == pickle.dumps(b)


def _same_output(raw: Path, dcp: Path) -> None:
    data = sorted(p.name for p in raw.glob("*.distcp"))
    assert data and data == sorted(p.name for p in dcp.glob("*.distcp"))
    for f in data:
        assert (raw / f).read_bytes() == (dcp / f).read_bytes(), f
    ours = pickle.loads((raw / ".metadata").read_bytes())
    theirs = pickle.loads((dcp / ".metadata").read_bytes())
    assert ours.storage_meta.checkpoint_id != theirs.storage_meta.checkpoint_id
    ours.storage_meta = theirs.storage_meta  # the staging path and a fresh UUID
    assert ours == theirs and ours.planner_data and ours.all_local_plans is None
    assert list(ours.storage_data) == list(theirs.storage_data)
    manifests = [json.loads((d / "ckpt-manifest.json").read_text()) for d in (raw, dcp)]
    for m in manifests:
        del m["files"][".metadata"], m["sizes"][".metadata"]
    assert manifests[0] == manifests[1] and manifests[0]["algorithm"] == "crc32"


@pytest.mark.parametrize("name,workers", [("mcore016_gpt_tp2pp2_bf16_optim", 1),
                                          ("dcp_plain", 2)])
def test_convert_to_dcp_raw_writes_what_dcp_save_writes(name, workers, tmp_path, monkeypatch,
                                                        raw_saves):
    """torch_dist source (common state and objects, rng_state tensors included, pickled
    without torch) and a plain DCP source (2 I/O threads): the same files as DCP's save;
    ``dcp.load`` and ``dcp_to_torch_save`` read them; ``validate --deep`` finds nothing."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt_tool.formats import open_checkpoint
    from ckpt_tool.ops.validate import validate

    src = _fixture(name)
    _convert(src, tmp_path / "dcp", monkeypatch, raw_saves, raw=False, workers=workers)
    _convert(src, tmp_path / "raw", monkeypatch, raw_saves, raw=True, workers=workers)
    _same_output(tmp_path / "raw", tmp_path / "dcp")
    for d in ("raw", "dcp"):
        dcp_to_torch_save(tmp_path / d, tmp_path / f"{d}.pt")
    ours, theirs = (torch.load(tmp_path / f"{d}.pt", weights_only=False) for d in ("raw", "dcp"))
    assert ours.keys() == theirs.keys()
    for k, v in ours.items():
        assert _equal(v, theirs[k]), k
    reader = open_checkpoint(src)
    tensors = reader.metadata().tensors
    md = pickle.loads((tmp_path / "raw" / ".metadata").read_bytes())
    keys = [k for k in md.state_dict_metadata if k in tensors][:12]
    assert keys
    state = {k: torch.empty(tuple(md.state_dict_metadata[k].size),
                            dtype=md.state_dict_metadata[k].properties.dtype) for k in keys}
    dcp.load(state, checkpoint_id=tmp_path / "raw", no_dist=True)
    for k in keys:
        assert _equal(state[k], reader.read(k)), k
    result = validate(tmp_path / "raw", deep=True)
    assert result.format == "dcp" and not result.findings, result.findings


def test_convert_torch_dist_to_dcp_never_imports_torch(tmp_path):
    """A torch_dist source read without torch (its common.pt and objects: torch dtypes in
    ``args``, rng_state tensors) converts to DCP, verified, without importing torch."""
    src = _fixture("mcore016_gpt_tp2pp2_bf16_optim") / "iter_0000010"
    code = ("import sys, json; from ckpt_tool.ops.convert import convert; "
            "from ckpt_tool.ops.convert import ConvertOptions; "
            "from ckpt_tool.formats.containers.dcp import dcp_torch_free_save as dcp_raw_save; saves = []; real = dcp_raw_save.torch_free_dcp_save; "
            "dcp_raw_save.torch_free_dcp_save = lambda d, *a, **k: saves.append(d) or real(d, *a, **k); "
            f"r = convert({str(src)!r}, {str(tmp_path / 'out')!r}, ConvertOptions(to='dcp'));"
            "print(json.dumps(['torch' in sys.modules, r.verified, len(saves)]))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, True, 1]
    assert (tmp_path / "out" / ".metadata").is_file()
    assert not (tmp_path / "out" / "metadata.json").exists()


@pytest.mark.parametrize("case", ["raw", "raw_save_false", "float8"])
def test_dcp_writer_chooses_the_raw_path_as_torch_dist_does(case, tmp_path, raw_saves):
    """The DCP writer takes the raw path unless ``extra["raw_save"]`` is False or a chunk is
    one the raw archive writer leaves to ``torch.save`` (float8); the output reads back the
    same either way (tensors, nested common state, an object)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for
    from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta

    dtype = torch.float8_e4m3fn if case == "float8" else torch.bfloat16
    data = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3).to(dtype),
            "b": torch.ones(5, dtype=torch.float32)}
    tensors = {"w": TensorMeta("w", str(dtype).removeprefix("torch."), (4, 3),
                               (ChunkRef((0, 0), (2, 3)), ChunkRef((2, 0), (2, 3)))),
               "b": TensorMeta("b", "float32", (5,))}

    class Source:
        def read(self, key, offsets, sizes):
            return data[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].clone()

    common = {"optimizer": {"param_groups": [{"lr": 0.5, "params": [0]}]}, "step": 7}
    req = WriteRequest(meta=CheckpointMeta("x", "", tensors, (ObjectMeta("obj", "obj"),)),
                       source=Source(), common=common, objects=lambda key: {"k": [1, 2]})
    extra = {"raw_save": False} if case == "raw_save_false" else {}
    writer_for("dcp")(tmp_path / "out", WriterOptions(extra=extra)).write(req)
    assert len(raw_saves) == (case == "raw")
    dcp_to_torch_save(tmp_path / "out", tmp_path / "out.pt")
    loaded = torch.load(tmp_path / "out.pt", weights_only=False)
    assert _equal(loaded["w"], data["w"]) and _equal(loaded["b"], data["b"])
    assert loaded["optimizer"] == common["optimizer"] and loaded["step"] == 7
    assert loaded["obj"] == {"k": [1, 2]}
