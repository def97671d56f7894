"""Feasibility: every reason a target layout cannot work, each with its fix; model sizes from
the fixtures' args and shapes; optimizer sharding types; objects; agreement with Megatron-Core's
TransformerConfig validation."""

from __future__ import annotations

import warnings

import pytest

from ckpt_tool.formats.base import open_checkpoint
from ckpt_tool.model import CheckpointMeta, ObjectMeta, TensorMeta
from ckpt_tool.planning.feasibility import (ERROR, NOTE, WARNING, check_layout, target_vocab_size,
                                            valid_tps)
from ckpt_tool.planning.source_model import OptimizerInfo, model_sizes_from, optimizer_info_from
from ckpt_tool.planning.source_layout import source_layout_from
from ckpt_tool.planning.sizes import Layout, ModelSizes

TINY = ModelSizes(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, padded_vocab_size=128, vocab_size=128,
                  make_vocab_size_divisible_by=64, gated_linear_unit=True)


def _errors(problems):
    return [p for p in problems if p.severity == ERROR]


@pytest.fixture(scope="module")
def dist():
    r = open_checkpoint("fixtures/mcore016_gpt_tp2pp2_fp32")
    return r.metadata(), r.common()


def test_sizes_from_dist_common_and_legacy_args(dist):
    meta, common = dist
    assert model_sizes_from(meta, common) == TINY
    assert source_layout_from(meta, common) == Layout(tp=2, pp=2, ep=1, etp=2)
    legacy = open_checkpoint("fixtures/megatron_legacy_tp2pp2").metadata()
    assert model_sizes_from(legacy) == TINY
    assert source_layout_from(legacy) == Layout(tp=2, pp=2, ep=1, etp=2)


def test_sizes_from_shapes_only(dist):
    meta, _ = dist
    bare = CheckpointMeta(format=meta.format, root="", tensors=meta.tensors)
    s = model_sizes_from(bare)
    assert (s.num_layers, s.hidden_size, s.ffn_hidden_size, s.padded_vocab_size,
            s.gated_linear_unit) == (4, 64, 128, 128, True)
    assert s.num_attention_heads is None and s.vocab_size is None


def test_valid_layouts_have_no_errors():
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            assert _errors(check_layout(TINY, Layout(tp=tp, pp=pp), source=Layout(2, 2))) == []


def test_every_reason_with_its_fix():
    probs = _errors(check_layout(TINY, Layout(tp=3, pp=3, ep=2), source=Layout(2, 2)))
    text = [p.reason for p in probs]
    assert any("num_attention_heads (4) is not a multiple of tp (3)" in t for t in text)
    assert any("num_query_groups (2) is neither a multiple nor a divisor of tp (3)" in t
               for t in text)
    assert any("ffn_hidden_size (128)" in t for t in text)
    assert any("QKV has 128 rows" in t for t in text)
    assert any("pp=3 cannot hold 4 layers" in t for t in text)
    assert any("ep=2 but the model has no experts" in t for t in text)
    assert all(p.fix for p in probs)
    f = probs[0].to_finding()
    assert f.severity == "error" and probs[0].fix in f.message and probs[0].reason in f.message
    assert "choose tp among 1, 2, 4" in probs[0].fix
    assert valid_tps(TINY) == [1, 2, 4]


def test_uneven_pipeline_and_vpp():
    s = TINY.with_(num_layers=6)
    assert _errors(check_layout(s, Layout(pp=4)))
    ok = check_layout(s, Layout(pp=3, first_stage_layers=1, last_stage_layers=1))
    assert _errors(ok) == []
    bad = _errors(check_layout(s, Layout(pp=3, first_stage_layers=1)))
    assert bad and "middle" in bad[0].reason and "--decoder-first" in bad[0].fix
    assert _errors(check_layout(TINY, Layout(pp=2, vpp=2))) == []
    assert "virtual" in _errors(check_layout(TINY, Layout(pp=2, vpp=3)))[0].reason


def test_tp_above_query_groups_is_allowed_and_noted():
    probs = check_layout(TINY, Layout(tp=4), source=Layout(2, 2))
    assert _errors(probs) == []
    assert any(p.severity == NOTE and "even 1/4 slice of the fused QKV" in p.reason
               for p in probs)


def test_experts():
    moe = TINY.with_(num_experts=8, moe_ffn_hidden_size=64)
    assert _errors(check_layout(moe, Layout(ep=4))) == []
    assert "does not divide the 8 experts" in _errors(check_layout(moe, Layout(ep=3)))[0].reason
    assert "expert tensor" in _errors(check_layout(moe, Layout(tp=1, etp=3)))[-1].reason


def test_vocab_repadding_is_reported():
    probs = check_layout(TINY, Layout(tp=4), source=Layout(2, 2))
    (note,) = [p for p in probs if p.key == "vocab"]
    assert note.severity == NOTE and "128 -> 256" in note.reason and "copies" in note.reason
    zero = [p for p in check_layout(TINY, Layout(tp=4), vocab_fill="zero") if p.key == "vocab"]
    assert "zeros" in zero[0].reason
    assert target_vocab_size(TINY, 4) == 256 and target_vocab_size(TINY, 1) == 128
    # without the true vocab a larger stored padding is kept, with a warning to pass it
    big = TINY.with_(padded_vocab_size=256, vocab_size=None)
    (w,) = [p for p in check_layout(big, Layout(tp=1), divisible_by=64) if p.key == "vocab"]
    assert w.severity == WARNING and "--vocab-size" in w.fix and "keeping 256 rows" in w.reason
    # with it, the padding shrinks to Megatron-LM's
    (n,) = [p for p in check_layout(big.with_(vocab_size=100), Layout(tp=1), divisible_by=64)
            if p.key == "vocab"]
    assert n.severity == NOTE and "256 -> 128" in n.reason and "dropped" in n.reason


@pytest.mark.parametrize("kind, refused", [
    ("fully_reshardable", False), ("fully_sharded_model_space", False),
    ("dp_reshardable", True), ("dp_zero_gather_scatter", True),
    ("legacy_distrib_optim", True), ("legacy_optimizer", True)])
def test_optimizer_sharding_types(kind, refused):
    opt = OptimizerInfo(kind)
    probs = check_layout(TINY, Layout(tp=4), opt, source=Layout(2, 2))
    errs = _errors(probs)
    assert bool(errs) == refused
    if refused:
        assert "cannot change tp/pp" in errs[0].reason and "--drop-optimizer" in errs[0].fix
        assert _errors(check_layout(TINY, Layout(tp=4), opt, source=Layout(2, 2),
                                    drop_optimizer=True)) == []
        # same tp/pp: copied as is
        assert _errors(check_layout(TINY, Layout(2, 2), opt, source=Layout(2, 2))) == []
    if kind == "fully_sharded_model_space":
        assert any("converted to model space" in p.reason for p in probs)


def test_optimizer_info_of_fixtures():
    assert optimizer_info_from(open_checkpoint(
        "fixtures/mcore016_gpt_tp2pp2_bf16_optim").metadata()).sharding == "fully_reshardable"
    assert optimizer_info_from(open_checkpoint(
        "fixtures/mcore015_gpt_flattened_optim").metadata()).sharding == \
        "fully_sharded_model_space"
    assert optimizer_info_from(open_checkpoint(
        "fixtures/mcore016_gpt_tp2pp2_fp32").metadata()).sharding is None
    # decided from the keys; the content metadata's claim is reported
    only = optimizer_info_from(open_checkpoint(
        "fixtures/mcore016_gpt_tp2pp2_modelonly").metadata())
    assert (only.sharding, only.claimed) == (None, "dp_reshardable")
    probs = check_layout(TINY, Layout(tp=4), only, source=Layout(2, 2))
    assert not _errors(probs)
    assert any(p.key == "optimizer" and "nothing to reshard or drop" in p.reason for p in probs)
    fp16 = optimizer_info_from(open_checkpoint(
        "fixtures/mcore016_gpt_tp2dp2_fp16opt").metadata())
    assert fp16.sharding == "non_distributed" and "non-distributed" in fp16.describe()
    synthetic = CheckpointMeta("torch_dist", "", tensors={
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32)"
        ".bucket_idx_0.exp_avg": TensorMeta("x", "float32", (10,))})
    assert optimizer_info_from(synthetic).sharding == "dp_reshardable"


def test_objects_dropped_or_kept(dist):
    meta, _ = dist
    probs = check_layout(TINY, Layout(tp=1), objects=meta.objects, source=Layout(2, 2))
    rng = [p for p in probs if p.key == "rng_state"]
    assert rng and "4 rng_state" in rng[0].reason and "--no-load-rng" in rng[0].reason
    assert any(p.key == "_extra_state" for p in probs)
    same = check_layout(TINY, Layout(2, 2), objects=meta.objects, source=Layout(2, 2))
    assert not [p for p in same if p.key == "rng_state"]
    assert [o for o in meta.objects if o.key == "rng_state"]
    assert isinstance(meta.objects[0], ObjectMeta)


@pytest.mark.interop
def test_tp_rules_equal_transformer_config():
    """Our head/query-group verdicts are Megatron-Core 0.16's TransformerConfig's."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    for heads, groups in [(4, 1), (4, 2), (4, 4), (8, 2), (12, 3), (12, 4), (6, 6)]:
        sizes = ModelSizes(num_attention_heads=heads, num_query_groups=groups,
                           kv_channels=64, num_layers=2)
        for tp in range(1, 13):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    TransformerConfig(num_layers=2, hidden_size=64 * heads,
                                      num_attention_heads=heads, num_query_groups=groups,
                                      tensor_model_parallel_size=tp)
                    accepted = True
                except ValueError:
                    accepted = False
            ours = [p for p in _errors(check_layout(sizes, Layout(tp=tp)))
                    if "num_attention_heads" in p.reason or "num_query_groups" in p.reason]
            assert accepted == (not ours), (heads, groups, tp, ours)


@pytest.mark.interop
def test_uneven_pipeline_rules_equal_transformer_config():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    for n, pp, first, last, vpp in [(6, 4, 1, None, None), (6, 3, 1, 1, None),
                                    (6, 3, 2, None, None), (6, 4, None, 2, None),
                                    (6, 2, 1, 3, None), (6, 3, 2, 2, None),
                                    (8, 3, 2, 2, 2), (8, 3, 1, 3, None), (10, 3, 2, 4, 2)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                TransformerConfig(num_layers=n, hidden_size=64, num_attention_heads=4,
                                  pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp,
                                  num_layers_in_first_pipeline_stage=first,
                                  num_layers_in_last_pipeline_stage=last,
                                  pipeline_dtype=torch.float32)
                accepted = True
            except ValueError:
                accepted = False
        sizes = TINY.with_(num_layers=n)
        ours = _errors(check_layout(sizes, Layout(pp=pp, vpp=vpp, first_stage_layers=first,
                                                  last_stage_layers=last)))
        assert accepted == (not ours), (n, pp, first, last, vpp, ours)


def test_null_tokenizer_vocab_holds_its_end_of_document_token(dist):
    """Megatron-LM's NullTokenizer of ``--vocab-size V`` has V + 1 tokens (end of document:
    id V), which its padding holds: V=128 at tp 2 pads to 256, and at tp 1 still to 256 (row
    128 is a token, not padding). Args written by hand with 128 padded rows keep 128."""
    meta, common = dist
    args = dict(vars(common["args"]), padded_vocab_size=256, make_vocab_size_divisible_by=128)
    real = {**common, "args": args}
    sizes = model_sizes_from(meta, real)
    assert sizes.vocab_size == 129 and target_vocab_size(sizes, 1) == 256
    assert model_sizes_from(meta, common).vocab_size == 128  # the fixture's own args
    other = {**real, "args": dict(args, tokenizer_type="GPT2BPETokenizer")}
    assert model_sizes_from(meta, other).vocab_size == 128
