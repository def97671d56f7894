"""Megatron-Core dist checkpoints (torch_dist and zarr): detection, metadata, reads.

Most tests build checkpoints with real torch DCP classes (``_builders``); the ``interop`` tests
save with the REAL megatron-core and compare our metadata and reads with its
``load_tensors_metadata`` / ``load_plain_tensors``, also on ``fixtures/`` when present.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _builders import split_grid, write_mcore_dist, write_zarr
from ckpt_tool.errors import CorruptCheckpointError, InputError, NotACheckpointError
from ckpt_tool.formats import detect, open_checkpoint
from ckpt_tool.formats.mcore_dist.reader import infer_optimizer_sharding

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"

W = torch.arange(24.0).reshape(4, 6)
L = torch.arange(48, dtype=torch.bfloat16).reshape(4, 3, 4)
COMMON = {"iteration": 10, "checkpoint_version": 3.0,
          "args": argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                     world_size=4, num_layers=4, hidden_size=6,
                                     padded_vocab_size=128),
          "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"}}


@pytest.fixture
def torch_dist(tmp_path):
    layer_chunks = [((i, 0, 2 * j), L[i:i + 1, :, 2 * j:2 * j + 2]) for i in range(4)
                    for j in range(2)]
    return write_mcore_dist(tmp_path / "iter_0000010", {
        "decoder.w": ((4, 6), split_grid(W, (2, 1))),
        "decoder.layers.mlp.linear_fc1.weight": ((4, 3, 4), layer_chunks),
    }, {"rng_state/shard_0.0_1.2": {"seed": 0}, "rng_state/shard_0.1_1.2": {"seed": 1}},
        common=COMMON)


def test_detect_and_resolve_save_dir(torch_dist):
    save = torch_dist.parent
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")
    for p in (torch_dist, save, torch_dist / "metadata.json"):
        assert detect(p).name == "torch_dist"
        assert Path(open_checkpoint(p).metadata().root) == torch_dist
    (save / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(NotACheckpointError, match="iter_0000020/ is missing"):
        detect(save)
    (save / "latest_checkpointed_iteration.txt").write_text("release")
    torch_dist.rename(save / "release")
    assert detect(save).name == "torch_dist"


def test_not_a_checkpoint_lists_reasons(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        detect(tmp_path / "missing")
    with pytest.raises(NotACheckpointError) as e:
        detect(tmp_path)
    assert "torch_dist: no metadata.json" in str(e.value) and "zarr:" in str(e.value)
    (tmp_path / "metadata.json").write_text("{not json")
    with pytest.raises(NotACheckpointError, match="not valid JSON"):
        detect(tmp_path)


def test_metadata(torch_dist):
    meta = open_checkpoint(torch_dist).metadata()
    assert meta.format == "torch_dist"
    assert set(meta.tensors) == {"decoder.w", "decoder.layers.mlp.linear_fc1.weight"}
    w = meta.tensors["decoder.w"]
    assert (w.dtype, w.shape, [c.offsets for c in w.chunks]) == ("float32", (4, 6), [(0, 0), (2, 0)])
    fc1 = meta.tensors["decoder.layers.mlp.linear_fc1.weight"]
    assert (fc1.dtype, fc1.shape, len(fc1.chunks)) == ("bfloat16", (4, 3, 4), 8)
    assert [o.unique_key for o in meta.objects] == ["rng_state/shard_0.0_1.2",
                                                    "rng_state/shard_0.1_1.2"]
    assert meta.common["iteration"] == 10
    assert meta.common["parallel"] == {"tp": 2, "pp": 1, "world_size": 4, "dp": 2}
    assert meta.common["model"]["padded_vocab_size"] == 128
    assert meta.extras["sharded_backend"] == "torch_dist" and meta.extras["dcp_version"] == "1.0.0"
    # content metadata says dp_reshardable (as Megatron-LM writes everywhere); no optimizer keys
    assert meta.extras["optimizer_sharding"] is None
    d = meta.to_dict()
    assert d["tensors"]["decoder.w"] == {"dtype": "float32", "shape": [4, 6], "chunks": 2,
                                         "nbytes": 96}


def test_read_full_slices_and_objects(torch_dist):
    r = open_checkpoint(torch_dist)
    assert torch.equal(r.read("decoder.w"), W)
    assert torch.equal(r.read("decoder.w", (slice(1, 3), slice(2, 5))), W[1:3, 2:5])
    assert torch.equal(r.read("decoder.layers.mlp.linear_fc1.weight",
                              (slice(2, 3), slice(None), slice(1, 3))), L[2:3, :, 1:3])
    assert r.read_object("rng_state/shard_0.1_1.2") == {"seed": 1}
    assert r.common()["args"].hidden_size == 6
    with pytest.raises(InputError):
        r.read("nope")


def test_read_detects_truncated_data_file(torch_dist):
    f = torch_dist / "__0_1.distcp"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        open_checkpoint(torch_dist).read("decoder.w")


def test_nd_reformulated_flattened_tensor(tmp_path):
    # Logical [4, 6] held as local [2, 3] blocks -> stored [2, 2, 6]; DP splits each block's
    # flat range in two (as the distributed optimizer does).
    logical = torch.arange(24.0).reshape(4, 6)
    stored = logical.reshape(2, 2, 2, 3).permute(0, 2, 1, 3).reshape(2, 2, 6)
    chunks = [((i, j, s), stored[i:i + 1, j:j + 1, s:s + n]) for i in range(2)
              for j in range(2) for s, n in ((0, 4), (4, 2))]
    key = "optimizer.state.exp_avg.decoder.w"
    ck = write_mcore_dist(tmp_path, {key: ((2, 2, 6), chunks)}, common={"iteration": 1},
                          mcore_data={key: {"nd_reformulated_orig_global_shape": (4, 6)}})
    r = open_checkpoint(ck)
    t = r.metadata().tensors[key]
    assert (t.shape, t.stored_shape, len(t.chunks)) == ((4, 6), (2, 2, 6), 8)
    assert r.metadata().extras["optimizer_sharding"]["type"] == "fully_sharded_model_space"
    assert torch.equal(r.read(key), logical)
    assert torch.equal(r.read(key, (slice(1, 4), slice(2, 3))), logical[1:4, 2:3])


def test_common_state_object_without_common_pt(tmp_path):
    # Newest MCore keeps the common state in DCP as the ShardedObject common_state/shard_0_1.
    ck = write_mcore_dist(tmp_path, {"w": ((2,), [((0,), torch.ones(2))])},
                          {"common_state/shard_0_1": {"iteration": 7, "args": COMMON["args"]}})
    r = open_checkpoint(ck)
    meta = r.metadata()
    assert meta.common["iteration"] == 7 and meta.common["parallel"]["tp"] == 2
    assert meta.extras["common_file"] is None
    assert r.common()["iteration"] == 7


def test_optimizer_sharding_inference():
    from ckpt_tool.model import ObjectMeta, TensorMeta

    def t(k, shape):
        return {k: TensorMeta(k, "float32", shape)}

    bucket = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.exp_avg"
    assert infer_optimizer_sharding(t(bucket, (10,)), [], None)["type"] == "dp_reshardable"
    obj = ObjectMeta("optimizer.distributed.dp_group_idx_0.param_state",
                     "optimizer.distributed.dp_group_idx_0.param_state/shard_0_1")
    assert infer_optimizer_sharding({}, [obj], None)["type"] == "dp_zero_gather_scatter"
    model = {**t("w", (4, 6)), **t("optimizer.state.exp_avg.w", (4, 6))}
    declared = {"distrib_optim_sharding_type": "dp_reshardable"}
    found = infer_optimizer_sharding(model, [], declared)
    assert (found["type"], found["declared"]) == ("non_distributed", "dp_reshardable")
    model.update(t("optimizer.state.param.w", (4, 6)))
    assert infer_optimizer_sharding(model, [], declared)["type"] == "fully_reshardable"
    assert infer_optimizer_sharding(t("w", (4, 6)), [], declared) is None
    flat = {**t("w", (4, 6)), **t("optimizer.state.exp_avg.w", (24,))}
    assert infer_optimizer_sharding(flat, [], None)["type"] == "fully_sharded_model_space"
    assert infer_optimizer_sharding(t("w", (4, 6)), [], {}) is None


@pytest.fixture
def zarr_ckpt(tmp_path):
    return write_zarr(tmp_path / "z", {
        "decoder.w": (W, (2, 3)),
        "decoder.layers.fc1.weight": (L, (1, 3, 2)),
        "decoder.b": (torch.arange(5, dtype=torch.float16), (5,)),
    }, {"rng_state/shard_0.0_1.2": {"seed": 0}, "rng_state/shard_0.1_1.2": {"seed": 1}},
        common=COMMON)


def test_zarr_metadata_and_reads(zarr_ckpt):
    (zarr_ckpt / "optimizer.state.fp32.w.sync").mkdir()  # leftover synchronizer: not an array
    r = open_checkpoint(zarr_ckpt)
    meta = r.metadata()
    assert meta.format == "zarr"
    assert set(meta.tensors) == {"decoder.w", "decoder.layers.fc1.weight", "decoder.b"}
    assert meta.tensors["decoder.layers.fc1.weight"].dtype == "bfloat16"
    assert meta.tensors["decoder.b"].dtype == "float16"
    w = meta.tensors["decoder.w"]
    assert [c.offsets for c in w.chunks] == [(0, 0), (0, 3), (2, 0), (2, 3)]
    assert [o.unique_key for o in meta.objects] == ["rng_state/shard_0.0_1.2",
                                                    "rng_state/shard_0.1_1.2"]
    assert meta.objects[1].global_offset == (0, 1) and meta.objects[1].global_shape == (1, 2)
    assert meta.common["iteration"] == 10
    assert torch.equal(r.read("decoder.w"), W)
    assert torch.equal(r.read("decoder.layers.fc1.weight", (slice(1, 3),)), L[1:3])
    assert r.read_object("rng_state/shard_0.1_1.2") == {"seed": 1}


def test_zarr_matches_tensorstore(zarr_ckpt):
    ts = pytest.importorskip("tensorstore")
    r = open_checkpoint(zarr_ckpt)
    arr = ts.open({"driver": "zarr", "metadata_key": ".zarray",
                   "kvstore": {"driver": "file", "path": str(zarr_ckpt / "decoder.layers.fc1.weight")}},
                  open=True).result().read().result()
    ours = r.read("decoder.layers.fc1.weight")
    assert torch.equal(ours.view(torch.int16), torch.from_numpy(arr.view("int16")))


def test_zarr_missing_chunk_file(tmp_path):
    ck = write_zarr(tmp_path / "z", {"decoder.w": (W, (2, 3))}, skip_chunks={("decoder.w", "1.1")})
    r = open_checkpoint(ck)
    assert len(r.metadata().tensors["decoder.w"].chunks) == 3
    assert torch.equal(r.read("decoder.w", (slice(0, 2),)), W[:2])
    with pytest.raises(CorruptCheckpointError, match="cover 18 of 24"):
        r.read("decoder.w")


def test_zarr_bad_zarray(zarr_ckpt):
    (zarr_ckpt / "decoder.w" / ".zarray").write_text("{")
    with pytest.raises(CorruptCheckpointError, match="unreadable .zarray"):
        open_checkpoint(zarr_ckpt).metadata()


# --- interop with the real megatron-core -------------------------------------------------

def _fixture_dirs():
    names = ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim",
             "mcore015_gpt_flattened_optim"]
    return [FIXTURES / n for n in names if (FIXTURES / n).is_dir()]


@pytest.mark.parametrize("name", ["mcore016_gpt_tp2pp2_fp32", "mcore016_gpt_tp2pp2_bf16_optim",
                                  "mcore015_zarr_gpt_tp2pp2", "mcore015_gpt_flattened_optim"])
def test_fixture_reads_match_chunks(name):
    """Real checkpoints: every tensor assembles; zarr ones equal tensorstore's reading."""
    if not (FIXTURES / name).is_dir():
        pytest.skip(f"fixtures/{name} not generated")
    r = open_checkpoint(FIXTURES / name)
    meta = r.metadata()
    assert meta.common.get("iteration") == 10 and meta.tensors
    for key, t in meta.tensors.items():
        x = r.read(key)
        assert tuple(x.shape) == t.shape and str(x.dtype) == f"torch.{t.dtype}", key
        if meta.format == "zarr":
            ts = pytest.importorskip("tensorstore")
            arr = ts.open({"driver": "zarr", "metadata_key": ".zarray", "kvstore": {
                "driver": "file", "path": str(Path(meta.root) / key)}}, open=True).result()
            ref = arr.read().result()
            ref_t = (torch.from_numpy(ref.view("int16")).view(torch.bfloat16)
                     if t.dtype == "bfloat16" else torch.from_numpy(ref))
            assert torch.equal(x, ref_t), key


def test_flattened_fixture_logical_layout():
    """MCore 0.15 fully_sharded_model_space: the un-reformulated fp32 main params, cast to the
    model dtype, equal the saved model weights (an independent check of the layout)."""
    if not (FIXTURES / "mcore015_gpt_flattened_optim").is_dir():
        pytest.skip("fixtures/mcore015_gpt_flattened_optim not generated")
    r = open_checkpoint(FIXTURES / "mcore015_gpt_flattened_optim")
    keys = [k for k, t in r.metadata().tensors.items()
            if k.startswith("optimizer.state.fp32_param.") and t.stored_shape is not None]
    assert keys
    for k in keys:
        model = r.read(k.removeprefix("optimizer.state.fp32_param."))
        assert torch.equal(r.read(k).to(model.dtype), model), k


@pytest.fixture(scope="module")
def mcore_views(tmp_path_factory):
    pytest.importorskip("megatron.core")
    out = tmp_path_factory.mktemp("mcore")
    worker = Path(__file__).parent / "_mcore_worker.py"
    saved = out / "ck"
    saved.mkdir()
    targets = {open_checkpoint(f).metadata().root: f for f in _fixture_dirs()}
    proc = subprocess.run([sys.executable, str(worker), str(out / "views.pt"), str(saved),
                           *targets], timeout=900, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    views = torch.load(out / "views.pt", weights_only=False)
    return {Path(targets.get(k, k)): v for k, v in views.items()}


@pytest.mark.interop
def test_matches_megatron_core(mcore_views):
    assert len(mcore_views) == 1 + len(_fixture_dirs())
    for ckpt, view in mcore_views.items():
        assert "error" not in view, (ckpt, view.get("error"))
        r = open_checkpoint(ckpt)
        meta = r.metadata()
        ours = {k: (t.dtype, t.stored_shape or t.shape) for k, t in meta.tensors.items()}
        assert ours == view["meta"], ckpt
        for key, tm in meta.tensors.items():
            expected = view["plain"][key]
            got = r.read(key)
            if tm.stored_shape is not None:  # MCore returns the reformulated (stored) shape
                grid = tm.stored_shape[:-1]
                local = [s // g for s, g in zip(tm.shape, grid)]
                n = len(grid)
                got = got.reshape([v for g, l in zip(grid, local) for v in (g, l)]).permute(
                    *range(0, 2 * n, 2), *range(1, 2 * n, 2)).reshape(tm.stored_shape)
            assert torch.equal(got, expected), (ckpt, key)
