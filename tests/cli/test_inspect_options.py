"""``ckpt inspect`` options: --filter, --tree, --objects, --common; metadata only."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "formats"))
from _builders import split_grid, write_mcore_dist  # noqa: E402

from ckpt_tool.cli.app import app  # noqa: E402

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
MCORE = FIXTURES / "mcore016_gpt_tp2pp2_fp32"
DCP = FIXTURES / "dcp_plain"
WIDE = {"COLUMNS": "200"}


@pytest.fixture
def ckpt(tmp_path):
    w = torch.arange(24.0).reshape(4, 6)
    layers = torch.zeros(4, 8, 6, dtype=torch.bfloat16)
    objects = {f"decoder.layers.mlp.fc1._extra_state/shard_{i}_30": {"i": i} for i in range(30)}
    objects["rng_state/shard_0.0_1.1"] = {"seed": 0}
    return write_mcore_dist(tmp_path / "iter_0000010", {
        "decoder.w": ((4, 6), split_grid(w, (2, 2))),
        "decoder.layers.self_attention.linear_qkv.weight":
            ((4, 8, 6), split_grid(layers, (4, 2, 1))),
        "decoder.layers.mlp.fc1.weight": ((4, 8, 6), split_grid(layers, (4, 1, 2))),
        "embedding.word_embeddings.weight": ((4, 6), split_grid(w, (1, 1))),
    }, objects, common={"iteration": 10, "checkpoint_version": 3.0,
                        "args": {"tensor_model_parallel_size": 2, "some_rare_flag": "xyz"}})


def _json(*args):
    result = runner.invoke(app, ["inspect", *map(str, args), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_filter_json_and_human(ckpt):
    doc = _json(ckpt, "--filter", r"layers\..*weight$")
    assert sorted(doc["tensors"]) == ["decoder.layers.mlp.fc1.weight",
                                      "decoder.layers.self_attention.linear_qkv.weight"]
    assert doc["objects"] == []
    assert doc["totals"]["tensors"] == 2
    doc = _json(ckpt, "--filter", "rng")
    assert doc["tensors"] == {} and [o["unique_key"] for o in doc["objects"]] == \
        ["rng_state/shard_0.0_1.1"]
    out = runner.invoke(app, ["inspect", str(ckpt), "--filter", "word_emb"], env=WIDE).output
    assert "embedding.word_embeddings.weight" in out and "decoder.w" not in out


@pytest.mark.parametrize("bad", ["decoder.(layers", "[", "*x"])
def test_invalid_filter_is_a_usage_error(ckpt, bad):
    for extra in ([], ["--json"]):
        result = runner.invoke(app, ["inspect", str(ckpt), "--filter", bad, *extra])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output and result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "not a valid regular expression" in lines[0]
        assert bad in lines[0]


def test_tree_json(ckpt):
    doc = _json(ckpt, "--tree")
    tree = doc["tree"]
    assert tree["tensors"] == 4 and tree["nbytes"] == doc["totals"]["nbytes"]
    top = {c["name"]: c for c in tree["children"]}
    assert set(top) == {"decoder", "embedding.word_embeddings"}  # single-child chain collapsed
    dec = top["decoder"]
    assert dec["tensors"] == 3
    layers = next(c for c in dec["children"] if c["name"] == "layers")
    assert {c["name"] for c in layers["children"]} == {"self_attention.linear_qkv", "mlp.fc1"}
    assert "tree" not in _json(ckpt)
    # --filter applies to the tree too
    assert _json(ckpt, "--tree", "--filter", "mlp")["tree"]["tensors"] == 1


def test_tree_human(ckpt):
    out = runner.invoke(app, ["inspect", str(ckpt), "--tree"], env=WIDE).output
    assert re.search(r"decoder\s+\(3 tensors, [\d.]+ \w*B\)", out), out
    # common args say TP=2: the TP split is named
    assert "self_attention.linear_qkv" in out and "tp 0-1 along dim 0 × 4 layers" in out
    assert "tp 0-1 along dim 1 × 4 layers" in out and "totals per dtype" in out
    doc = _json(ckpt)
    assert doc["tensors"]["decoder.w"]["split"] == "4 chunks: dim0 ×2 × dim1 ×2"  # ambiguous


def test_objects_summary_and_full(ckpt):
    out = runner.invoke(app, ["inspect", str(ckpt)], env=WIDE).output
    assert "31 sharded objects in 2 keys" in out and "--objects" in out
    assert "shard_17_30" not in out
    out = runner.invoke(app, ["inspect", str(ckpt), "--objects"], env=WIDE).output
    for i in range(30):
        assert f"decoder.layers.mlp.fc1._extra_state/shard_{i}_30" in out
    assert "rng_state/shard_0.0_1.1" in out and ".distcp" in out


def test_common_in_full(ckpt):
    out = runner.invoke(app, ["inspect", str(ckpt)], env=WIDE).output
    assert "some_rare_flag" not in out
    out = runner.invoke(app, ["inspect", str(ckpt), "--common"], env=WIDE).output
    assert "common state (full)" in out and '"some_rare_flag": "xyz"' in out
    doc = _json(ckpt, "--common")
    assert doc["common"]["args"] == {"tensor_model_parallel_size": 2, "some_rare_flag": "xyz"}


@pytest.mark.skipif(not MCORE.is_dir(), reason="fixture not generated")
def test_common_namespace_args_in_full_without_torch_reads():
    doc = _json(MCORE, "--common")
    args = doc["common"]["args"]  # argparse.Namespace, every field
    assert args["tokenizer_type"] == "NullTokenizer" and args["num_layers"] == 4
    assert len(args) > 30 and doc["common"]["iteration"] == 10


def test_metadata_only_tensor_data_is_never_read(tmp_path, monkeypatch):
    """Every data file emptied: inspect with every option still works (no byte of tensor data
    is read), and no reader's read() is ever called."""
    if not MCORE.is_dir():
        pytest.skip("fixture not generated")
    ck = Path(shutil.copytree(MCORE / "iter_0000010", tmp_path / "ck"))
    full = _json(ck, "--tree", "--common")
    for f in ck.glob("*.distcp"):
        f.write_bytes(b"")
    from ckpt_tool.formats.base import Reader

    def boom(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(Reader, "read", boom)
    for sub in Reader.__subclasses__():
        monkeypatch.setattr(sub, "read", boom, raising=False)
    doc = _json(ck, "--tree", "--common")
    assert doc["tensors"] == full["tensors"] and doc["tree"] == full["tree"]
    out = runner.invoke(app, ["inspect", str(ck), "--tree", "--objects", "--common"])
    assert out.exit_code == 0, out.output


_OPENED: list[str] | None = None  # while set, every file the process opens or maps


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event in ("open", "mmap.__new__") and args:
        _OPENED.append(str(args[0]))


def test_work_does_not_grow_with_tensor_bytes(tmp_path):
    """Same metadata, real data files vs sparse 1 GiB ones: the same result, and no data file
    is opened at all (what was read is observed, never how long it took)."""
    global _OPENED
    if not MCORE.is_dir():
        pytest.skip("fixture not generated")
    small = Path(shutil.copytree(MCORE / "iter_0000010", tmp_path / "small"))
    big = Path(shutil.copytree(MCORE / "iter_0000010", tmp_path / "big"))
    for f in big.glob("*.distcp"):
        with open(f, "r+b") as fh:
            fh.truncate(1 << 30)  # sparse: no disk used, but 8 GiB "of data" in all
    sys.addaudithook(_audit)  # (a no-op while _OPENED is None)
    _OPENED = []
    try:
        d_small = _json(small, "--tree")
        d_big = _json(big, "--tree")
        opened = list(_OPENED)
    finally:
        _OPENED = None
    assert d_small["tensors"] == d_big["tensors"]
    assert any(o.endswith(".metadata") for o in opened)  # the hook sees the reads it should
    assert not [o for o in opened if o.endswith(".distcp")], opened


@pytest.mark.skipif(not DCP.is_dir(), reason="fixture not generated")
def test_dcp_uneven_split_words():
    doc = _json(DCP, "--filter", r"^model\.head")
    assert doc["tensors"]["model.head.weight"]["split"] == "2 chunks: irregular: 3+2 along dim 0"
    assert doc["tensors"]["model.head.bias"]["split"] == "2 chunks: irregular: 3+2 along dim 0"
