"""Bounded memory of the commands that read and write ``torch_dist``: the anonymous memory a
command holds at its peak stays near the largest tensor, whatever the checkpoint's size.

Two GPT-shaped checkpoints written by the real ``torch.distributed.checkpoint.save`` as
Megatron-Core stores them (``_dist_dirs``: stacked ``decoder.layers.*`` tensors one chunk per
layer), with the same largest tensors (embedding and output layer, 32 MiB each) and 4x apart
in total (~100 MB, ~390 MB), and a tiny one for the baseline. Each command runs in a child
whose ``RssAnon`` is sampled (``_peak_memory``); its peak less the same command's on the tiny
checkpoint (same imports) must stay under 2x the largest tensor on both sizes, and the big
checkpoint's may not exceed the small one's by a largest tensor: memory does not grow with
the checkpoint. With ``--workers 2`` two pieces are in flight: under 3x. File-backed pages
(``RssFile``: the mapped checkpoint files, shared libraries) are printed, not bounded: they are
clean and reclaimable.

Found by this test: ``--to safetensors`` gathered a stacked tensor in slabs of up to 256 MiB
(+244 MB at 600 MB, growing with the layers; now pieces no bigger than a stored chunk), and
the verify pass of every command mapped runs of 256 MiB of the output two or three at a
time (~450 MB of ``RssFile``; now 64 MiB runs).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _dist_dirs import gpt_bytes, gpt_dirs  # noqa: E402
from _peak_memory import ckpt_peak  # noqa: E402

SIZES = {"tiny": dict(hidden=64, layers=2, vocab=1024),
         "small": dict(hidden=512, layers=2, vocab=16384),
         "big": dict(hidden=512, layers=20, vocab=16384)}
LARGEST = 32 << 20
COMMANDS = {  # name -> (arguments after SRC OUT, pieces in flight at once)
    "convert --to torch_dist": (["convert", "--to", "torch_dist"], 1),
    "convert --to torch_dist --workers 2": (["convert", "--to", "torch_dist",
                                             "--workers", "2"], 2),
    "convert --to safetensors": (["convert", "--to", "safetensors"], 1),
    "convert --to safetensors --workers 2": (["convert", "--to", "safetensors",
                                              "--workers", "2"], 2),
    "convert --to dcp": (["convert", "--to", "dcp"], 1),
    "reshard --tp 2": (["reshard", "--tp", "2"], 1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torch_dist_memory")
    dirs = {name: root / name for name in SIZES}
    gpt_dirs({dirs[name]: sizes for name, sizes in SIZES.items()})
    return dirs


def test_sizes_differ_but_not_the_largest_tensor():
    small, big = gpt_bytes(**SIZES["small"]), gpt_bytes(**SIZES["big"])
    assert small["largest"] == big["largest"] == LARGEST
    assert big["total"] > 3.9 * small["total"] > 3 * LARGEST


@pytest.mark.parametrize("name", list(COMMANDS))
def test_anonymous_peak_stays_near_the_largest_tensor(name, checkpoints, tmp_path):
    args, in_flight = COMMANDS[name]
    peaks = {}
    for size, src in checkpoints.items():
        out = tmp_path / size
        peaks[size] = ckpt_peak(args[0], src, out, *args[1:], "--no-progress")
        shutil.rmtree(out)
    above = {size: (peaks[size].anon - peaks["tiny"].anon) / LARGEST for size in ("small", "big")}
    print(f"{name}: peak RssAnon / RssFile MiB",
          {size: (p.anon >> 20, p.file >> 20) for size, p in peaks.items()},
          "anon above tiny, x largest tensor:", {k: round(v, 2) for k, v in above.items()})
    bound = 1.0 + in_flight
    for size, ratio in above.items():
        assert ratio < bound, (f"{name} on the {size} checkpoint: peak anonymous memory "
                               f"{ratio:.2f}x the largest tensor above the tiny one's "
                               f"({peaks[size].anon >> 20} MiB), bound {bound}x")
    assert above["big"] - above["small"] < 1.0, (
        f"{name}: peak anonymous memory grows with the checkpoint: {above['small']:.2f}x the "
        f"largest tensor at ~100 MB, {above['big']:.2f}x at ~390 MB")
