"""``torch_dist`` written by our streaming writer is read by the REAL Megatron-Core 0.16.1.

Fixtures of every kind are written through a TensorSource over ``open_checkpoint(fixture)``
(some at the source's chunk grid, some with dim 0 cut in 3), then one torchrun rank (gloo,
CPU) runs Megatron-Core on the outputs: ``load_tensors_metadata``, ``load_plain_tensors``,
``load_common_state_dict``, every ShardedObject through ``load``, and ``load`` of every tensor
at another sharding (two ShardedTensors per key, cut along its first even dimension).
This file is also that worker (``python test_writers_mcore.py OUT CKPT...``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from _compare import same_value

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
# (fixture, dim-0 pieces of the target grid; None: the source's grid)
CASES = [("mcore016_gpt_tp2pp2_fp32", None), ("mcore016_gpt_tp2pp2_bf16_optim", 3),
         ("mcore015_gpt_flattened_optim", 3), ("mcore015_zarr_gpt_tp2pp2", None),
         ("megatron_legacy_tp2pp2", None), ("dcp_plain", 3)]


class _Source:
    def __init__(self, reader):
        self.reader = reader

    def read(self, key, offsets, sizes):
        slices = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        return self.reader.read(key, slices or None).contiguous()


def _target(meta, split):
    from ckpt_tool.model import ChunkRef, CheckpointMeta, TensorMeta

    tensors = {}
    for k, t in meta.tensors.items():
        if split and t.shape and t.shape[0] >= split:
            b = [round(i * t.shape[0] / split) for i in range(split + 1)]
            chunks = tuple(ChunkRef((x, *(0,) * (len(t.shape) - 1)), (y - x, *t.shape[1:]))
                           for x, y in zip(b, b[1:]))
        elif split or t.stored_shape is not None or not t.chunks:
            chunks = (ChunkRef((0,) * len(t.shape), tuple(t.shape)),)
        else:
            chunks = tuple(ChunkRef(o, s) for o, s in
                           {c.offsets: c.sizes for c in t.chunks}.items())
        tensors[k] = TensorMeta(k, t.dtype, t.shape, chunks)
    return CheckpointMeta(format="target", root="", tensors=tensors, objects=meta.objects)


def _halves(shape):
    """``(dim, [(offsets, sizes), ...])``: the tensor cut in 2 along its first even dim."""
    d = next((i for i, n in enumerate(shape) if n % 2 == 0 and n > 0), None)
    if d is None:
        return None, []
    half = list(shape)
    half[d] //= 2
    return d, [(tuple(i * half[d] if j == d else 0 for j in range(len(shape))), tuple(half))
               for i in range(2)]


# -- the test (pytest) --------------------------------------------------------------------------
if __name__ != "__main__":
    if importlib.util.find_spec("megatron.core") is None:  # imported only in the worker
        pytest.skip("megatron-core is not installed", allow_module_level=True)
    pytestmark = [pytest.mark.interop, pytest.mark.multiproc,
                  pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def mcore_reads(tmp_path_factory):
    from launch import torchrun

    from ckpt_tool.formats import open_checkpoint
    from ckpt_tool.formats.writer import WriteRequest, WriterOptions, writer_for

    root = tmp_path_factory.mktemp("writers_mcore")
    written = {}
    for name, split in CASES:
        if not (FIXTURES / name).is_dir():
            continue
        src = open_checkpoint(FIXTURES / name)
        out = root / name
        out.mkdir()
        req = WriteRequest(meta=_target(src.metadata(), split), source=_Source(src),
                           common=src.common(), objects=src.read_object)
        notes = writer_for("torch_dist")(out, WriterOptions()).write(req)
        written[name] = (src, req, notes, out)
    result = root / "mcore.pt"
    torchrun(str(Path(__file__).resolve()), 1, str(result),
             *(str(w[3]) for w in written.values()), timeout=600)
    return written, torch.load(result, weights_only=False)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_mcore_reads_our_torch_dist(name, mcore_reads):
    from plainify import plainify

    written, results = mcore_reads
    if name not in written:
        pytest.skip(f"fixture {name} is missing")
    src, req, notes, out = written[name]
    theirs = results[str(out)]
    assert "error" not in theirs, theirs.get("error")
    # tensors: the same keys, dtypes, shapes and bits as our source holds
    assert theirs["meta"] == {k: (getattr(torch, t.dtype), tuple(t.shape))
                              for k, t in req.meta.tensors.items()}
    for k in req.meta.tensors:
        assert same_value(theirs["plain"][k], src.read(k)), k
    # load at another sharding
    assert theirs["pieces"]
    for (k, offsets, sizes), value in theirs["pieces"].items():
        expected = src.read(k, tuple(slice(o, o + s) for o, s in zip(offsets, sizes)))
        assert same_value(value, expected), (k, offsets)
    # ShardedObjects, and the common state (plus objects MCore could not take as ShardedObjects)
    for key, value in theirs["objects"].items():
        assert same_value(value, plainify(src.read_object(key))), key
    common = src.common()
    moved = {o.unique_key: src.read_object(o.unique_key) for o in req.meta.objects
             if o.unique_key not in theirs["objects"] and o.unique_key not in common}
    assert same_value(theirs["common"], plainify({**common, **moved}))
    assert len(theirs["objects"]) + len(moved) + sum(
        o.unique_key in common for o in req.meta.objects) == len(req.meta.objects)


# -- the worker (torchrun, 1 rank) ----------------------------------------------------------------
def _worker(out: str, ckpts: list[str]) -> None:
    import torch.distributed as dist
    from dist_worker import import_lib
    from plainify import plainify

    dist.init_process_group("gloo")
    lib, _ = import_lib("mcore")
    results = {}
    for ckpt in ckpts:
        try:
            meta = {k: (v.dtype, tuple(v.global_shape))
                    for k, v in lib.load_tensors_metadata(ckpt).items()}
            plain = {k: v for k, v in lib.load_plain_tensors(ckpt).items() if k in meta}
            objects = {}
            for key, sh in lib.serialization.load_sharded_metadata(ckpt).items():
                if isinstance(sh, lib.ShardedObject):
                    # one object of several: not a complete access pattern
                    objects[key] = lib.load({"o": sh}, ckpt,
                                            validate_access_integrity=False)["o"]
            sd, where = {}, {}
            for k, (dtype, shape) in meta.items():
                d, pieces = _halves(shape)
                for i, (offsets, sizes) in enumerate(pieces):
                    name = f"{k}|{i}"
                    sd[name] = lib.ShardedTensor.from_rank_offsets(
                        k, torch.empty(sizes, dtype=dtype), (d, i, 2), replica_id=0)
                    where[name] = (k, offsets, sizes)
            loaded = lib.load(sd, ckpt)  # the halves cover every tensor: integrity checked
            results[ckpt] = {"meta": meta, "plain": plain, "objects": plainify(objects),
                             "common": plainify(lib.load_common_state_dict(ckpt)),
                             "pieces": {where[n]: loaded[n] for n in where}}
        except Exception as exc:  # noqa: BLE001  reported to the test
            import traceback

            results[ckpt] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
    torch.save(results, out)


if __name__ == "__main__":
    import os

    # MCore's common.pt loader uses torch.load's weights_only default, which refuses the numpy
    # scalars of Megatron-LM args; Megatron-LM allowlists them, these files are ours.
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    _worker(sys.argv[1], sys.argv[2:])
    from ckpt_tool._torchrun import exit_cleanly

    exit_cleanly(0)
