"""The derived views of ``ops.inspect`` (pure functions of CheckpointMeta, no I/O): how a
tensor is split, totals per dtype, the --filter, the module tree, object groups."""

import pytest

from ckpt_tool.errors import UsageError
from ckpt_tool.model import CheckpointMeta, ChunkRef, ObjectMeta, TensorMeta
from ckpt_tool.ops.inspect import (InspectResult, compile_filter, describe_split, dtype_totals,
                                   filter_meta, object_groups, tensor_tree, tp_size)


def _grid(key, shape, frags, dtype="float32", stored=None):
    chunks = [((), ())]
    for dim, n in enumerate(frags):
        size = shape[dim] // n
        chunks = [(off + (i * size,), sz + (size,)) for off, sz in chunks for i in range(n)]
    return TensorMeta(key, dtype, shape, tuple(ChunkRef(o, s) for o, s in chunks),
                      stored_shape=stored)


def _uneven(key, shape, dim, sizes):
    chunks, pos = [], 0
    for s in sizes:
        off = [0] * len(shape)
        sz = list(shape)
        off[dim], sz[dim] = pos, s
        chunks.append(ChunkRef(tuple(off), tuple(sz)))
        pos += s
    return TensorMeta(key, "float32", shape, tuple(chunks))


def test_describe_split():
    assert describe_split(_grid("w", (4, 6), (1, 1))) == "1 chunk: whole"
    assert describe_split(_grid("w", (4, 6), (2, 2))) == "4 chunks: dim0 ×2 × dim1 ×2"
    assert describe_split(_grid("emb", (128, 6), (2, 1))) == "2 chunks: dim0 ×2"
    assert describe_split(_grid("decoder.layers.linear_qkv.weight", (4, 8, 6), (4, 2, 1))) == \
        "8 chunks: dim0 ×2 × 4 layers"
    assert describe_split(_grid("decoder.layers.linear_proj.weight", (4, 8, 6), (4, 1, 2))) == \
        "8 chunks: dim1 ×2 × 4 layers"
    assert describe_split(_grid("decoder.layers.norm.weight", (4, 6), (4, 1))) == \
        "4 chunks: 4 layers"
    assert describe_split(_grid("decoder.layers.mlp.experts.fc1.weight", (2, 4, 8, 6),
                                (2, 4, 1, 2))) == "16 chunks: dim1 ×2 × 4 experts × 2 layers"
    # per-layer keys of heterogeneous models: dim0 is a real dimension
    assert describe_split(_grid("decoder.layers.3.fc.weight", (4, 6), (4, 1))) == \
        "4 chunks: dim0 ×4"
    assert describe_split(TensorMeta("x", "float32", (4,), ())) == "no chunks stored"
    partial = TensorMeta("x", "float32", (4,), (ChunkRef((0,), (3,)),))
    assert describe_split(partial) == "1 chunk: irregular, cover 3/4 elements"
    flat = TensorMeta("o", "float32", (4, 6), (ChunkRef((0, 0, 0), (1, 1, 6)),) * 4,
                      stored_shape=(2, 2, 6))
    assert describe_split(flat) == "4 chunks: flattened (N-D reformulated, block grid 2×2)"


def test_describe_split_uneven_and_replicas():
    # FSDP2 Shard(0) of 5 rows on 2 ranks: 3 + 2
    assert describe_split(_uneven("head.weight", (5, 8), 0, [3, 2])) == \
        "2 chunks: irregular: 3+2 along dim 0"
    assert describe_split(_uneven("b", (7,), 0, [2, 2, 3])) == \
        "3 chunks: irregular: 2+2+3 along dim 0"
    rep = TensorMeta("r", "float32", (4,), (ChunkRef((0,), (4,)),) * 2)
    assert describe_split(rep) == "2 chunks: whole ×2 (replicas)"
    assert describe_split(TensorMeta("s", "float32", (), (ChunkRef((), ()),))) == \
        "1 chunk: scalar"
    # overlapping pieces: not a grid
    ov = TensorMeta("o", "float32", (4,), (ChunkRef((0,), (3,)), ChunkRef((2,), (2,))))
    assert describe_split(ov).startswith("2 chunks: irregular")


def test_describe_split_names_the_tp_split():
    qkv = _grid("decoder.layers.linear_qkv.weight", (4, 8, 6), (4, 2, 1))
    assert describe_split(qkv, tp=2) == "8 chunks: tp 0-1 along dim 0 × 4 layers"
    proj = _grid("decoder.layers.linear_proj.weight", (4, 8, 8), (4, 1, 4))
    assert describe_split(proj, tp=4) == "16 chunks: tp 0-3 along dim 1 × 4 layers"
    assert describe_split(_grid("emb", (128, 6), (2, 1)), tp=2) == "2 chunks: tp 0-1 along dim 0"
    # GLU fc1 on TP=2 holds 4 pieces along dim 0: not labelled as TP
    fc1 = _grid("decoder.layers.mlp.linear_fc1.weight", (4, 16, 6), (4, 4, 1))
    assert describe_split(fc1, tp=2) == "16 chunks: dim0 ×4 × 4 layers"
    # two dims with tp pieces: ambiguous, not labelled
    assert describe_split(_grid("w", (4, 6), (2, 2)), tp=2) == "4 chunks: dim0 ×2 × dim1 ×2"
    assert describe_split(_uneven("h", (5, 8), 0, [3, 2]), tp=2) == \
        "2 chunks: irregular: 3+2 along dim 0"
    assert tp_size(CheckpointMeta("x", "/", common={"parallel": {"tp": 2}})) == 2
    assert tp_size(CheckpointMeta("x", "/", common={"parallel": {"tp": 1}})) is None
    assert tp_size(CheckpointMeta("x", "/")) is None


def test_dtype_totals():
    meta = CheckpointMeta("x", "/", tensors={
        "a": _grid("a", (4, 6), (1, 1)), "b": _grid("b", (10,), (2,), "bfloat16"),
        "c": _grid("c", (2,), (1,))})
    assert dtype_totals(meta) == {"bfloat16": {"tensors": 1, "numel": 10, "nbytes": 20},
                                  "float32": {"tensors": 2, "numel": 26, "nbytes": 104}}


def _meta():
    keys = ["decoder.layers.mlp.fc1.weight", "decoder.layers.mlp.fc1.bias",
            "decoder.layers.attn.qkv.weight", "decoder.final_norm.weight",
            "embedding.word_embeddings.weight", "output_layer.weight"]
    tensors = {k: _grid(k, (4, 8), (2, 1)) for k in keys}
    objects = (ObjectMeta("rng_state", "rng_state/shard_0.0_1.2", "__0_0.distcp", 0, 10),
               ObjectMeta("rng_state", "rng_state/shard_0.1_1.2", "__1_0.distcp", 0, 12),
               ObjectMeta("decoder.layers.mlp.fc1._extra_state",
                          "decoder.layers.mlp.fc1._extra_state/shard_0_4", "__0_0.distcp"))
    return CheckpointMeta("torch_dist", "/ck", tensors=tensors, objects=objects)


def test_filter_meta():
    meta = _meta()
    f = filter_meta(meta, r"mlp\.fc1")
    assert sorted(f.tensors) == ["decoder.layers.mlp.fc1.bias", "decoder.layers.mlp.fc1.weight"]
    assert [o.unique_key for o in f.objects] == ["decoder.layers.mlp.fc1._extra_state/shard_0_4"]
    assert [o.key for o in filter_meta(meta, "shard_0.1").objects] == ["rng_state"]
    assert filter_meta(meta, None) is meta
    assert filter_meta(meta, "^nothing$").tensors == {}
    assert meta.tensors and len(meta.objects) == 3  # the input is untouched


def test_invalid_regex_is_a_usage_error():
    with pytest.raises(UsageError, match="not a valid regular expression") as e:
        compile_filter("decoder.(layers")
    assert e.value.exit_code == 2 and "\n" not in e.value.one_line()


def test_tensor_tree():
    tree = tensor_tree(_meta())
    assert tree["name"] == "" and tree["tensors"] == 6 and tree["nbytes"] == 6 * 128
    top = {c["name"]: c for c in tree["children"]}
    assert set(top) == {"decoder", "embedding.word_embeddings", "output_layer"}
    dec = top["decoder"]  # two children (layers, final_norm): not collapsed
    assert dec["tensors"] == 4 and dec["nbytes"] == 4 * 128
    sub = {c["name"]: c for c in dec["children"]}
    assert set(sub) == {"layers", "final_norm"}
    layers = sub["layers"]
    assert {c["name"] for c in layers["children"]} == {"mlp.fc1", "attn.qkv"}  # chains collapse
    fc1 = next(c for c in layers["children"] if c["name"] == "mlp.fc1")
    leaf = next(c for c in fc1["children"] if c["name"] == "weight")
    assert leaf == {"name": "weight", "key": "decoder.layers.mlp.fc1.weight",
                    "dtype": "float32", "shape": [4, 8], "split": "2 chunks: dim0 ×2",
                    "nbytes": 128, "tensors": 1, "children": []}
    emb = top["embedding.word_embeddings"]
    assert [c["name"] for c in emb["children"]] == ["weight"]

    def walk(node):  # every node has the documented fields
        assert {"name", "nbytes", "tensors", "children"} <= set(node)
        kids = sum(c["tensors"] for c in node["children"])
        assert node["tensors"] == (1 if "key" in node else kids)
        for c in node["children"]:
            walk(c)
    walk(tree)


def test_tree_in_to_dict_and_empty():
    res = InspectResult(meta=_meta())
    assert "tree" not in res.to_dict()
    assert res.to_dict(tree=True)["tree"]["tensors"] == 6
    assert tensor_tree(CheckpointMeta("x", "/")) == {"name": "", "nbytes": 0, "tensors": 0,
                                                      "children": []}


def test_object_groups():
    assert object_groups(_meta()) == [
        {"key": "decoder.layers.mlp.fc1._extra_state", "count": 1, "nbytes": 0},
        {"key": "rng_state", "count": 2, "nbytes": 22}]
