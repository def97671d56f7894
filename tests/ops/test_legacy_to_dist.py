"""Megatron-LM legacy files -> a Megatron-Core dist checkpoint (``convert --to torch_dist`` and
``reshard``): Megatron-Core's stacked names and its ``_extra_state`` objects, as Megatron-LM's
``--ckpt-convert-format torch_dist`` gives them (loading the files into the model, saving it).

The reference: ``fixtures/megatron_legacy_tp2pp2`` and ``fixtures/mcore016_gpt_tp2pp2_fp32``
hold the same global tensors, the second saved by the real Megatron-Core 0.16.1 from the model
(local spec); ``tests/peer/test_legacy_convert.py`` compares with Megatron-LM's own
conversion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.convert import ConvertOptions
from ckpt_tool.ops.convert import convert
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
LEGACY = FIX / "megatron_legacy_tp2pp2"
DIST = FIX / "mcore016_gpt_tp2pp2_fp32"
MOE = FIX / "megatron_legacy_moe_vpp"
# a TENorm's, which Megatron-Core asks for wherever Transformer Engine is installed (this
# reference was saved without it)
FINAL_NORM = "decoder.final_layernorm._extra_state/shard_0_1"


def assert_model_as_megatron_core_saves(ours: Path, theirs: Path) -> None:
    """Every model tensor of ``theirs`` (names, shapes, dtypes, values) and every
    ``_extra_state`` object, stored byte for byte as there; ``ours`` adds only the final
    norm's."""
    with open_checkpoint(ours) as a, open_checkpoint(theirs) as b:
        ma, mb = a.metadata(), b.metadata()
        model = {k for k in mb.tensors if not k.startswith("optimizer.")}
        assert set(ma.tensors) == model
        for k in model:
            assert (ma.tensors[k].shape, ma.tensors[k].dtype) == \
                (mb.tensors[k].shape, mb.tensors[k].dtype), k
            assert torch.equal(a.read(k), b.read(k)), k
        extra_a = {o.unique_key for o in ma.objects if o.key.endswith("._extra_state")}
        extra_b = {o.unique_key for o in mb.objects if o.key.endswith("._extra_state")}
        assert extra_b and extra_a - extra_b == {FINAL_NORM}
        for key in extra_b:
            assert a.stored_object_bytes(key) == b.stored_object_bytes(key), key
        assert a.read_object(FINAL_NORM).dtype == torch.uint8  # TE's, without FP8 state


def assert_rng_objects(path: Path) -> None:
    """Each rank file's ``rng_state`` as the object Megatron-LM's resume at the same layout
    asks for; none left in the common state."""
    with open_checkpoint(path) as out, open_checkpoint(LEGACY) as src:
        rng = {o.unique_key for o in out.metadata().objects if o.key == "rng_state"}
        assert rng == {f"rng_state/shard_{p}.{t}_2.2" for p in range(2) for t in range(2)}
        want = src.read_object("rng_state/mp_rank_01_000")  # tp 1, pp 0
        got = out.read_object("rng_state/shard_0.1_2.2")
        assert isinstance(got, list) and torch.equal(got[0]["torch_rng_state"],
                                                     want[0]["torch_rng_state"])
        assert "rng_state" not in out.common()


def test_convert_gives_megatron_cores_names_objects_and_values(tmp_path):
    result = convert(LEGACY, tmp_path / "o", ConvertOptions(to="torch_dist"))
    assert_model_as_megatron_core_saves(tmp_path / "o", DIST)
    assert_rng_objects(tmp_path / "o")
    assert "renamed 48 per-layer keys to Megatron-Core's stacked names (12 keys, layer axis " \
           "first, local-spec norms as linear_qkv/linear_fc1.layer_norm_*)" in result.notes
    assert "added 17 _extra_state objects as Megatron-Core saves them for the local layer " \
           "spec" in result.notes


def test_reshard_to_dist_gives_them_too(tmp_path):
    result = reshard(LEGACY, tmp_path / "o", ReshardRequest(to="torch_dist"))
    assert result.written
    assert_model_as_megatron_core_saves(tmp_path / "o", DIST)
    assert_rng_objects(tmp_path / "o")  # the layout is kept
    assert any(n.startswith("renamed 48 per-layer keys") for n in result.notes)


def test_the_command_says_what_it_renamed(tmp_path):
    result = CliRunner().invoke(app, ["convert", str(LEGACY), str(tmp_path / "o"), "--to",
                                      "torch_dist", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "renamed 48 per-layer keys to Megatron-Core's stacked names" in result.stderr
    assert "added 17 _extra_state objects" in result.stderr


@pytest.mark.parametrize("to", ["torch_dist", "zarr"])
def test_moe_layers_local_spec(tmp_path, to):
    """A local-spec MoE model (TP1 PP2 VPP2 EP2 files): routed experts stacked over layers and
    global experts, the pre-MLP norm under the name the local spec's keys map gives it (as in
    ``fixtures/mcore016_moe_ep2_distopt_buckets``), an object per layer and expert."""
    convert(MOE, tmp_path / "o", ConvertOptions(to=to))
    meta = open_checkpoint(tmp_path / "o").metadata()
    assert meta.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape[:2] == (4, 4)
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in meta.tensors
    assert not [k for k in meta.tensors if "pre_mlp_layernorm" in k or "input_layernorm" in k]
    keys = {o.unique_key for o in meta.objects if o.key.endswith("._extra_state")}
    assert {f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_{i}.{e}_4.4"
            for i in range(4) for e in range(4)} <= keys
    assert "decoder.layers.mlp.shared_experts.linear_fc2._extra_state/shard_3_4" in keys
    assert FINAL_NORM not in keys  # a MoE model's final norm follows its (local) block spec
    assert len(keys) == 4 * (2 + 2 + 2 * 4)
