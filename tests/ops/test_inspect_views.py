"""The derived views of ``ops.inspect``: how a tensor is split, totals per dtype."""

from ckpt_tool.model import CheckpointMeta, ChunkRef, TensorMeta
from ckpt_tool.ops.inspect import describe_split, dtype_totals


def _grid(key, shape, frags, dtype="float32", stored=None):
    chunks = [((), ())]
    for dim, n in enumerate(frags):
        size = shape[dim] // n
        chunks = [(off + (i * size,), sz + (size,)) for off, sz in chunks for i in range(n)]
    return TensorMeta(key, dtype, shape, tuple(ChunkRef(o, s) for o, s in chunks),
                      stored_shape=stored)


def test_describe_split():
    assert describe_split(_grid("w", (4, 6), (1, 1))) == "1 chunk: whole"
    assert describe_split(_grid("w", (4, 6), (2, 2))) == "4 chunks: dim0 ×2, dim1 ×2"
    assert describe_split(_grid("emb", (128, 6), (2, 1))) == "2 chunks: dim0 ×2"
    assert describe_split(_grid("decoder.layers.linear_qkv.weight", (4, 8, 6), (4, 2, 1))) == \
        "8 chunks: layers ×4 × dim0 ×2"
    assert describe_split(_grid("decoder.layers.norm.weight", (4, 6), (4, 1))) == \
        "4 chunks: layers ×4"
    assert describe_split(_grid("decoder.layers.mlp.experts.fc1.weight", (2, 4, 8, 6),
                                (2, 4, 1, 2))) == "16 chunks: layers ×2 × experts ×4 × dim1 ×2"
    # per-layer keys of heterogeneous models: dim0 is a real dimension
    assert describe_split(_grid("decoder.layers.3.fc.weight", (4, 6), (4, 1))) == "4 chunks: dim0 ×4"
    assert describe_split(TensorMeta("x", "float32", (4,), ())) == "no chunks stored"
    partial = TensorMeta("x", "float32", (4,), (ChunkRef((0,), (3,)),))
    assert describe_split(partial) == "1 chunk: irregular, cover 3/4 elements"
    flat = TensorMeta("o", "float32", (4, 6), (ChunkRef((0, 0, 0), (1, 1, 6)),) * 4,
                      stored_shape=(2, 2, 6))
    assert describe_split(flat) == "4 chunks: flattened (N-D reformulated, block grid 2×2)"


def test_dtype_totals():
    meta = CheckpointMeta("x", "/", tensors={
        "a": _grid("a", (4, 6), (1, 1)), "b": _grid("b", (10,), (2,), "bfloat16"),
        "c": _grid("c", (2,), (1,))})
    assert dtype_totals(meta) == {"bfloat16": {"tensors": 1, "numel": 10, "nbytes": 20},
                                  "float32": {"tensors": 2, "numel": 26, "nbytes": 104}}
