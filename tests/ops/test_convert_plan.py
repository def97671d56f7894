"""plan_convert: the target metadata of a conversion, on real fixture metadata (no data read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tool.errors import UsageError
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.convert import ConvertOptions, parse_rename, plan_convert

FIX = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def bf16_optim():
    return open_checkpoint(FIX / "mcore016_gpt_tp2pp2_bf16_optim").metadata()


@pytest.fixture(scope="module")
def flattened():
    return open_checkpoint(FIX / "mcore015_gpt_flattened_optim").metadata()


def test_dist_target_keeps_the_source_chunk_grid(bf16_optim):
    plan = plan_convert(bf16_optim, ConvertOptions(to="torch_dist"))
    assert set(plan.target.tensors) == set(bf16_optim.tensors)
    for key, t in plan.target.tensors.items():
        src = bf16_optim.tensors[key]
        assert t.shape == src.shape and t.dtype == src.dtype
        assert sorted(c.offsets for c in t.chunks) == sorted({c.offsets for c in src.chunks})
        assert all(c.file is None for c in t.chunks)


def test_single_file_targets_get_one_chunk(bf16_optim):
    plan = plan_convert(bf16_optim, ConvertOptions(to="torch"))
    assert all(len(t.chunks) == 1 and t.chunks[0].sizes == t.shape
               for t in plan.target.tensors.values())


def test_safetensors_keeps_the_grid_as_the_pieces_to_pull(bf16_optim):
    """Its writer pulls pieces no bigger than the largest stored chunk (bounded memory)."""
    plan = plan_convert(bf16_optim, ConvertOptions(to="safetensors"))
    ref = plan_convert(bf16_optim, ConvertOptions(to="torch_dist"))
    for key, t in plan.target.tensors.items():
        assert t.chunks == ref.target.tensors[key].chunks
    assert any(len(t.chunks) > 1 for t in plan.target.tensors.values())


def test_flattened_optimizer_state_becomes_whole_model_space_tensors(flattened):
    plan = plan_convert(flattened, ConvertOptions(to="torch_dist"))
    flat = [k for k, t in flattened.tensors.items() if t.stored_shape is not None]
    assert flat
    for key in flat:
        t = plan.target.tensors[key]
        assert t.shape == flattened.tensors[key].shape
        assert [c.sizes for c in t.chunks] == [t.shape]


def test_dtype_casts_floating_tensors_only(bf16_optim):
    plan = plan_convert(bf16_optim, ConvertOptions(to="safetensors", dtype="fp32"))
    assert {t.dtype for t in plan.target.tensors.values()} == {"float32"}
    assert set(plan.dtypes) == {k for k, t in bf16_optim.tensors.items()
                                if t.dtype != "float32"}


def test_model_only_filter_exclude_rename(bf16_optim):
    plan = plan_convert(bf16_optim, ConvertOptions(
        to="safetensors", model_only=True, exclude=r"layer_norm", filter=r"^decoder\.",
        rename=parse_rename(["decoder.=model.decoder."])))
    keys = set(plan.target.tensors)
    assert keys and all(k.startswith("model.decoder.") and "layer_norm" not in k for k in keys)
    assert all(plan.key_map[k] == k.removeprefix("model.") for k in keys)
    expected = {k for k in bf16_optim.tensors if k.startswith("decoder.")
                and "layer_norm" not in k}
    assert set(plan.key_map.values()) == expected
    assert any("left out" in n for n in plan.notes)


def test_max_memory_splits_big_chunks_along_rows(bf16_optim):
    plan = plan_convert(bf16_optim, ConvertOptions(to="torch_dist", max_memory=2048))
    t = plan.target.tensors["embedding.word_embeddings.weight"]  # 128x64 bf16, chunks of 64 rows
    assert all(c.numel * 2 <= 2048 for c in t.chunks)
    assert sum(c.numel for c in t.chunks) == t.numel


@pytest.mark.parametrize("opts,match", [
    (dict(to="onnx"), "unknown target format"),
    (dict(to="torch", dtype="int3"), "unknown --dtype"),
    (dict(to="torch", filter="("), "bad --filter regex"),
])
def test_bad_options_are_usage_errors(bf16_optim, opts, match):
    with pytest.raises(UsageError, match=match):
        plan_convert(bf16_optim, ConvertOptions(**opts))


def test_rename_collision_is_refused(bf16_optim):
    with pytest.raises(UsageError, match="maps both"):
        plan_convert(bf16_optim, ConvertOptions(
            to="torch", rename=(("embedding.word_embeddings.", "w."),
                                ("output_layer.", "w."))))


def test_parse_rename_requires_equals():
    with pytest.raises(UsageError):
        parse_rename(["decoder."])
