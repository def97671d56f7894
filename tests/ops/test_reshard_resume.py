"""reshard for resuming real Megatron-LM checkpoints (issue 11): the optimizer form is decided
from the keys, the training state travels, the source layout and vocab are never guessed."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from ckpt_tool.cli.app import app
from ckpt_tool.formats import open_checkpoint
from ckpt_tool.ops.reshard import ReshardRequest, reshard

FIX = Path(__file__).resolve().parents[2] / "fixtures"
MODEL_ONLY = FIX / "mcore016_gpt_tp2pp2_modelonly"
FP16OPT = FIX / "mcore016_gpt_tp2dp2_fp16opt"
runner = CliRunner()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as r:
        return {k: r.read(k).clone() for k in r.metadata().tensors}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def test_model_only_with_dp_reshardable_metadata_is_not_refused(tmp_path):
    # Megatron-LM writes distrib_optim_sharding_type=dp_reshardable into every checkpoint
    result = reshard(MODEL_ONLY, tmp_path / "o", ReshardRequest(tp=1, pp=2))
    assert result.ok and result.written
    opt = result.plan["optimizer"]
    assert (opt["form"], opt["action"], opt["tensors"]) == (None, "none", 0)
    assert opt["content_metadata_says"] == "dp_reshardable"
    assert not [p for p in result.plan["problems"] if p["severity"] == "error"]
    _same(_tensors(MODEL_ONLY), _tensors(tmp_path / "o"))


def test_non_distributed_optimizer_is_resharded_with_the_model(tmp_path):
    result = reshard(FP16OPT, tmp_path / "a", ReshardRequest(tp=1, pp=2))
    assert result.ok and result.written
    opt = result.plan["optimizer"]
    assert opt["form"] == "non_distributed" and opt["action"] == "resharded with the model"
    assert opt["tensors"] == 48
    src = _tensors(FP16OPT)
    assert any(k.startswith("optimizer.state.fp32_param.") for k in src)
    _same(src, _tensors(tmp_path / "a"))
    # the content metadata and the optimizer's common state travel unchanged
    with open_checkpoint(FP16OPT) as r0, open_checkpoint(tmp_path / "a") as r1:
        c0, c1 = r0.common(), r1.common()
    assert c1["content_metadata"] == c0["content_metadata"]
    assert torch.equal(c1["optimizer"]["optimizer"]["state"]["common_step"],
                       c0["optimizer"]["optimizer"]["state"]["common_step"])
    assert c1["optimizer"]["optimizer"]["param_groups"] == \
        c0["optimizer"]["optimizer"]["param_groups"]


def test_check_names_the_optimizer_form_and_what_happens(tmp_path):
    res = runner.invoke(app, ["reshard", str(FP16OPT), "--tp", "4", "--check", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["optimizer"]["form"] == "non_distributed"
    assert doc["optimizer"]["content_metadata_says"] == "dp_reshardable"
    res = runner.invoke(app, ["reshard", str(MODEL_ONLY), "--tp", "1", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "optimizer: no optimizer state" in res.stdout and "-> none" in res.stdout
    res = runner.invoke(app, ["reshard", str(FP16OPT), "--tp", "1", "--check"])
    assert "non-distributed optimizer" in res.stdout and "resharded with the model" in res.stdout
    # legacy rank files hold no model-space optimizer state: said before anything is written
    res = runner.invoke(app, ["reshard", str(FP16OPT), "--tp", "1", "--to", "legacy",
                              "--check", "--json"])
    doc = json.loads(res.stdout)
    assert doc["optimizer"]["action"].startswith("left out")
    assert any(p["severity"] == "warning" and "--no-load-optim" in p["fix"]
               for p in doc["problems"])


DIST = FIX / "mcore016_gpt_tp2pp2_fp32"


def _without_args(tmp_path: Path, src: Path = DIST) -> Path:
    """A copy of a real fixture whose common state has no args (Megatron-Core's own saves,
    NeMo, hand-made checkpoints)."""
    import shutil

    out = tmp_path / "noargs"
    shutil.copytree(next(src.glob("iter_*")), out)
    common = torch.load(out / "common.pt", weights_only=False)
    del common["args"]
    torch.save(common, out / "common.pt")
    return out


def test_source_layout_without_args_is_read_from_the_checkpoint(tmp_path):
    # no args: pp and tp from the rng_state objects' (pp, tp) global shape
    src = _without_args(tmp_path)
    res = runner.invoke(app, ["reshard", str(src), "--tp", "4", "--check", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["source_layout"]["tp"], doc["source_layout"]["pp"]) == (2, 2)
    assert doc["source_layout"]["origins"] == {"tp": "rng_state objects",
                                               "pp": "rng_state objects", "ep": "no experts"}
    assert doc["target_layout"]["pp"] == 2
    res = runner.invoke(app, ["reshard", str(src), "--tp", "4", "--check"])
    assert "tp2 pp2 ep1 -> tp4 pp2 ep1" in res.stderr  # it used to say "tp1 pp1 -> tp4"


def test_source_layout_without_args_or_rng_state_is_inferred_or_unknown():
    import pytest

    from ckpt_tool.errors import UsageError
    from ckpt_tool.model import ChunkRef, TensorMeta
    from ckpt_tool.ops.reshard import _target_layout
    from ckpt_tool.planning.source_layout import source_layout_origins

    meta = open_checkpoint(DIST).metadata()
    bare = type(meta)(meta.format, meta.root, tensors=meta.tensors, objects=(), common={})
    assert source_layout_origins(bare, {}) == {"tp": "chunk grid", "pp": "unknown",
                                               "ep": "no experts"}
    with pytest.raises(UsageError, match="pp size is unknown") as e:
        _target_layout(ReshardRequest(tp=4), bare, {})
    assert "--pp" in e.value.hint
    layout, origins = _target_layout(ReshardRequest(pp=2), bare, {})
    assert (layout.tp, origins["tp"]) == (2, "source: chunk grid")
    # chunk grids that disagree tell nothing
    emb = TensorMeta("embedding.word_embeddings.weight", "float32", (128, 64),
                     chunks=(ChunkRef((0, 0), (128, 64)),))
    odd = type(meta)(meta.format, meta.root, tensors={**meta.tensors, emb.key: emb})
    assert source_layout_origins(odd, {})["tp"] == "unknown"


def test_unpadded_vocab_rows_are_kept_without_args(tmp_path):
    # 128 rows at tp2 are not Megatron-LM's padding (a multiple of 128 x 2): keep them
    src = _without_args(tmp_path)
    result = reshard(src, tmp_path / "o", ReshardRequest(tp=4, pp=2))
    assert result.written
    notes = [p for p in result.plan["problems"] if p["key"] == "vocab"]
    assert notes and "vocab rows 128 kept" in notes[0]["reason"]
    got = open_checkpoint(tmp_path / "o").metadata().tensors
    assert got["embedding.word_embeddings.weight"].shape == (128, 64)
    _same(_tensors(src), _tensors(tmp_path / "o"))


def test_no_args_reshard_to_legacy_reproduces_megatron_lm_files(tmp_path):
    """No args, TP2 PP2 -> legacy TP2 PP2: every rank file equals the one Megatron-LM wrote for
    the same model (megatron_legacy_tp2pp2): the 128 vocab rows are kept (re-padding them to
    256 at tp2 would not load into that model with a strict load_state_dict)."""
    src = _without_args(tmp_path)
    reshard(src, tmp_path / "o", ReshardRequest(tp=2, pp=2, to="legacy", local_spec=True))
    want = sorted((FIX / "megatron_legacy_tp2pp2").glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    got = sorted((tmp_path / "o").glob("*/mp_rank_*/model_optim_rng.pt"))
    assert [p.parent.name for p in want] == [p.parent.name for p in got]
    for a, b in zip(want, got):
        x = torch.load(a, weights_only=False)["model"]
        y = torch.load(b, weights_only=False)["model"]
        assert set(x) == set(y), a  # the linears' _extra_state entries (None) too
        assert all(y[k] is None if x[k] is None else
                   x[k].shape == y[k].shape and torch.equal(x[k], y[k]) for k in x), a


def test_unpadded_vocab_rows_that_the_new_tp_does_not_divide_name_the_flags():
    from ckpt_tool.model import CheckpointMeta
    from ckpt_tool.planning.feasibility import ERROR, vocab_kept_unpadded
    from ckpt_tool.planning.sizes import ModelSizes

    sizes = ModelSizes(padded_vocab_size=1000)
    meta = CheckpointMeta("torch_dist", "")
    kept, note = vocab_kept_unpadded(sizes, meta, {}, 2, 4)
    assert kept.vocab_size == 1000 and kept.make_vocab_size_divisible_by == 1
    assert note.severity == "note"
    _, err = vocab_kept_unpadded(sizes, meta, {}, 2, 3)
    assert err.severity == ERROR and "--vocab-size" in err.fix
    assert "--make-vocab-size-divisible-by" in err.fix
    # Megatron-LM-padded rows (a multiple of 128 x tp) or args: unchanged behaviour
    assert vocab_kept_unpadded(ModelSizes(padded_vocab_size=1024), meta, {}, 2, 4)[1] is None
    args = {"args": {"vocab_size": 1000}}
    assert vocab_kept_unpadded(sizes, meta, args, 2, 4)[1] is None


def test_training_state_travels_and_args_follow_the_new_layout(tmp_path):
    result = reshard(FP16OPT, tmp_path / "o", ReshardRequest(tp=1, pp=2))
    # the old layout's rng_state: dropped, with its note
    assert any(p["key"] == "rng_state" and "--no-load-rng" in p["reason"]
               for p in result.plan["problems"])
    with open_checkpoint(FP16OPT) as r0, open_checkpoint(tmp_path / "o") as r1:
        c0, c1 = r0.common(), r1.common()
        assert not [o for o in r1.metadata().objects if o.key == "rng_state"]
    for k in ("iteration", "checkpoint_version", "opt_param_scheduler", "content_metadata",
              "num_floating_point_operations_so_far"):
        assert c1[k] == c0[k], k
    a0, a1 = vars(c0["args"]), vars(c1["args"])
    # what Megatron-LM compares or derives on resume
    assert (a1["tensor_model_parallel_size"], a1["pipeline_model_parallel_size"]) == (1, 2)
    assert a1["data_parallel_size"] == a0["data_parallel_size"] == 2
    assert a1["world_size"] == 1 * 2 * 2 and a0["world_size"] == 4
    assert a1["padded_vocab_size"] == 128 and a1["iteration"] == a0["iteration"]
    changed = {k for k in a0 if a0[k] != a1.get(k)}
    assert changed <= {"tensor_model_parallel_size", "pipeline_model_parallel_size",
                       "expert_tensor_parallel_size", "world_size"}, changed
    # legacy targets carry the same training state in every rank file
    reshard(FP16OPT, tmp_path / "l", ReshardRequest(tp=1, to="legacy", drop_optimizer=True))
    state = torch.load(next((tmp_path / "l").glob("iter_*/mp_rank_00/model_optim_rng.pt")),
                       weights_only=False)
    for k in ("iteration", "checkpoint_version", "opt_param_scheduler"):
        assert state[k] == c0[k], k
    assert state["args"].tensor_model_parallel_size == 1 and state["args"].world_size == 2


def test_legacy_targets_name_norms_from_args_transformer_impl(tmp_path):
    # the resume fixtures' args say transformer_impl="local": local-spec names by default
    reshard(MODEL_ONLY, tmp_path / "l", ReshardRequest(tp=1, pp=1, to="legacy"))
    model = torch.load(next((tmp_path / "l").glob("iter_*/mp_rank_00/model_optim_rng.pt")),
                       weights_only=False)["model"]
    assert "decoder.layers.0.input_layernorm.weight" in model
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in model
    assert not any("layer_norm_weight" in k for k in model)
    res = runner.invoke(app, ["reshard", str(MODEL_ONLY), str(tmp_path / "te"), "--tp", "1",
                              "--pp", "1", "--to", "legacy", "--te-spec"])
    assert res.exit_code == 0, res.output
    model = torch.load(next((tmp_path / "te").glob("iter_*/mp_rank_00/model_optim_rng.pt")),
                       weights_only=False)["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
    res = runner.invoke(app, ["reshard", str(MODEL_ONLY), "--tp", "1", "--to", "legacy",
                              "--check"])
    assert "legacy norm names: local spec (input_layernorm.*) " \
        "(args.transformer_impl='local')" in res.stdout
