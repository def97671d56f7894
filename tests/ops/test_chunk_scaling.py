"""Work per chunk stays constant as a tensor's chunk count grows (no pass over every chunk
for each chunk read or checked).

A stacked-layer tensor of N layers (or one layer of N experts) x 2 tensor-parallel halves
has 2N chunks; resharding it to 4 parts reads 4N rectangles, each half of a stored chunk. Counting the Python calls made
(``sys.setprofile``: a deterministic count, not a timing) for N and 4N chunks: linear work
grows 4x, a scan of all chunks per read 16x. The same for proving the chunk grid of a
target (``check_grid``) and of a checkpoint being validated (``check_coverage``) when the
experts per layer grow (the layer x expert grids of MoE checkpoints).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.formats.containers.dcp.dcp_torch_free_metadata import check_grid
from ckpt_tool.model import ChunkRef, TensorMeta
from ckpt_tool.ops.validate._checks import check_coverage
from ckpt_tool.ops._torch_free_source import TorchFreeSource
from ckpt_tool.planning.overlap import grid_tiling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from _builders import write_mcore_dist  # noqa: E402

KEY = "decoder.layers.mlp.linear_fc1.weight"


def _calls(fn) -> int:
    """Python-level calls (function and generator frames) made while ``fn()`` runs."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _read_quarters(root: Path, layers: int, experts: int) -> int:
    """Python calls made reading, from a checkpoint of a [layers, experts, 4, 3] tensor stored
    as one chunk per layer, expert and half (dim 2), every quarter of it (each request half
    of a stored chunk: not an exact chunk); what was read is checked."""
    full = torch.arange(layers * experts * 12, dtype=torch.float32).reshape(layers, experts, 4, 3)
    chunks = [((layer, e, half * 2, 0), full[layer:layer + 1, e:e + 1, half * 2:half * 2 + 2])
              for layer in range(layers) for e in range(experts) for half in range(2)]
    write_mcore_dist(root, {KEY: (tuple(full.shape), [(o, t.clone()) for o, t in chunks])},
                     files=1, common={"iteration": 1})
    source = TorchFreeSource(open_checkpoint(root), {KEY: KEY}, {})
    got = np.zeros(tuple(full.shape), dtype=np.float32)

    def read_all() -> None:
        for layer in range(layers):
            for e in range(experts):
                for q in range(4):
                    got[layer, e, q] = source.read(KEY, (layer, e, q, 0), (1, 1, 1, 3)) \
                        .view(np.float32)

    calls = _calls(read_all)
    source.close()
    assert np.array_equal(got, full.numpy())
    return calls


@pytest.mark.parametrize("grow", ["layers", "experts"])
def test_reading_every_chunk_of_a_tensor_is_linear(tmp_path, grow):
    small = _read_quarters(tmp_path / "a", *((60, 1) if grow == "layers" else (1, 60)))
    big = _read_quarters(tmp_path / "b", *((240, 1) if grow == "layers" else (1, 240)))
    assert big < 6 * small, (small, big)  # 4x the chunks; a scan per read gives ~16x


def _grid(layers: int, experts: int, *, gap: bool = False, overlap: bool = False
          ) -> TensorMeta:
    chunks = [ChunkRef((layer, e, 0), (1, 1, 8)) for layer in range(layers)
              for e in range(experts)]
    if gap:
        chunks.pop(len(chunks) // 2)
    if overlap:
        chunks[-1] = ChunkRef((layers - 1, experts - 2, 4), (1, 1, 4))
        chunks.append(ChunkRef((layers - 1, experts - 1, 0), (1, 1, 8)))
    return TensorMeta(KEY, "float32", (layers, experts, 8), tuple(chunks))


@pytest.mark.parametrize("check", [check_grid, check_coverage], ids=["check_grid",
                                                                      "check_coverage"])
def test_proving_a_layer_by_expert_grid_is_linear(check):
    small = _calls(lambda: check(_grid(64, 16)))
    big = _calls(lambda: check(_grid(64, 64)))  # 4x the experts per layer
    assert big < 6 * small, (small, big)


def test_grid_tiling_proves_grids_and_nothing_else():
    assert grid_tiling((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)),
                                ((2, 3), (2, 3))])
    assert grid_tiling((), [((), ())])
    boxes = [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))]  # tiles, but not a grid
    assert not grid_tiling((4, 6), boxes)
    assert not grid_tiling((4, 6), boxes[:2])  # a gap
    assert not grid_tiling((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)),
                                    ((2, 3), (2, 3)), ((2, 3), (2, 3))])  # a box twice
    assert not grid_tiling((4, 6), [((0, 0), (2, 4)), ((0, 3), (2, 3)), ((2, 0), (2, 4)),
                                    ((2, 3), (2, 3))])  # overlapping along an axis
    assert not grid_tiling((4, 6), [((0, 0), (4, 6)), ((0, 0), (4, 6))])


def test_not_a_grid_still_gets_the_pairwise_verdict():
    with pytest.raises(Exception, match="tile"):
        check_grid(_grid(4, 4, gap=True))
    with pytest.raises(Exception, match="overlap|tile"):
        check_grid(_grid(4, 4, overlap=True))
    assert any("gap" in f.message or "cover" in f.message for f in check_coverage(
        _grid(4, 4, gap=True)))
    assert any("overlap" in f.message for f in check_coverage(_grid(4, 4, overlap=True)))
    assert check_coverage(_grid(4, 4)) == []
