"""``formats.mcore_dist.weights_only``: numpy scalars of a common state become the Python
scalars of the same value; everything else is kept (the same objects where nothing changes)."""

import argparse
import io

import numpy as np
import torch

from ckpt_tool.formats.mcore_dist.weights_only import weights_only_common


def test_numpy_scalars_become_python_scalars_that_weights_only_loads():
    args = argparse.Namespace(init_method_std=np.float64(0.02), seed=np.int64(7),
                              fp16=np.bool_(False), lr=np.float32(0.5), name="gpt",
                              dtype=torch.bfloat16)
    rng = np.arange(3, dtype=np.uint32)
    common = {"args": args, "optimizer": {"param_groups": [{"lr": np.float16(1.5)}]},
              "rng": rng, "iteration": 10}
    out, changed = weights_only_common(common)
    assert sorted(changed) == ["args.fp16", "args.init_method_std", "args.lr", "args.seed",
                               "optimizer.param_groups[0].lr"]
    assert type(out["args"].init_method_std) is float and out["args"].init_method_std == 0.02
    assert type(out["args"].seed) is int and type(out["args"].fp16) is bool
    assert out["args"].dtype is torch.bfloat16 and out["rng"] is rng
    assert type(common["args"].init_method_std) is np.float64  # the source's is untouched
    buf = io.BytesIO()
    torch.save([out], buf)
    buf.seek(0)
    with torch.serialization.safe_globals([argparse.Namespace, np.dtype,
                                           np.dtypes.UInt32DType,
                                           np._core.multiarray._reconstruct, np.ndarray]):
        back = torch.load(buf, weights_only=True)[0]
    assert back["args"].init_method_std == 0.02


def test_nothing_to_change_keeps_the_same_objects():
    common = {"args": argparse.Namespace(a=1.0), "x": [1, (2, "3")]}
    out, changed = weights_only_common(common)
    assert out is common and changed == []
